"""Who may open a page: signed in (else the sign-in page), with a role (else a page that says so).

The same rule as the API (``model:read`` for every read): a user without a role sees no rows, so
an empty page would only puzzle them; they get a 403 page telling them to ask for one. A form that
changes something needs ``model:write`` (:func:`writer_refusal`), checked before any row is looked
up, as the API does; a row the user may not see is a 404 page (:func:`sae_or_404`).
"""

from collections.abc import Callable
from functools import wraps

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from mistudio import roles
from mistudio.errors import ApplicationError
from saes.models import SparseAutoencoder
from saes.selectors import sae_get


def reader_required(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """``login_required``, then the ``model:read`` role (403 with an explanation without it)."""

    @wraps(view)
    def with_role(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if not request.user.has_perm(roles.READ):
            return render(request, "frontend/no_role.html", status=403)
        return view(request, *args, **kwargs)

    return login_required(with_role)


def writer_refusal(request: HttpRequest) -> HttpResponse | None:
    """None for a ``model:write`` user; else the 403 page saying that the form needs that role."""
    if request.user.has_perm(roles.WRITE):
        return None
    return render(request, "frontend/no_role.html", {"needs_write": True}, status=403)


def sae_or_404(user, sae_id: str) -> SparseAutoencoder:
    """The SAE, if the user may see it; else the 404 page (the API's ``SAE_NOT_FOUND``)."""
    try:
        return sae_get(user=user, sae_id=sae_id)
    except ApplicationError as error:
        raise Http404(error.message) from None
