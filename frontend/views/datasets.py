"""Pages: datasets."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render


@login_required
def dataset_list_page(request):
    return render(request, "frontend/stub.html", {"title": "Datasets"})


@login_required
def dataset_detail_page(request, dataset_id: str):
    return render(request, "frontend/stub.html", {"title": "Dataset"})
