"""What the pages of jobs share (an SAE group's training, an explanation job): the cancel form."""

from collections.abc import Callable
from typing import Any

from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import redirect, render

from mistudio.errors import ApplicationError


def cancel_form(request, *, cancel: Callable[[], Any], cancelling: str, back: str) -> HttpResponse:
    """A job page's POST (``action=cancel``): cancel the job, say what happens now (``cancelling``),
    and go back to the page; anything else is a 400."""
    if request.POST.get("action") != "cancel":
        return render(
            request, "frontend/partials/cache_error.html", {"message": "Unknown action: cancel."}, status=400
        )
    try:
        cancel()
        messages.info(request, cancelling)
    except ApplicationError as error:
        messages.error(request, error.message)
    return redirect(back)
