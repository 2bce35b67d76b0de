"""Pages: models."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render


@login_required
def model_list_page(request):
    return render(request, "frontend/stub.html", {"title": "Models"})


@login_required
def model_detail_page(request, model_id: str):
    return render(request, "frontend/stub.html", {"title": "Model"})
