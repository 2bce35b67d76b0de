"""Pages: activations."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render


@login_required
def cache_list_page(request):
    return render(request, "frontend/stub.html", {"title": "Activations"})


@login_required
def cache_browser_page(request, cache_id: str):
    return render(request, "frontend/stub.html", {"title": "Activation cache"})
