"""Pages: playground."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render


@login_required
def playground_page(request):
    return render(request, "frontend/stub.html", {"title": "Playground"})
