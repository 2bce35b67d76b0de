"""Who may open a page: signed in (else the sign-in page), with a role (else a page that says so).

The same rule as the API (``model:read`` for every read): a user without a role sees no rows, so
an empty page would only puzzle them; they get a 403 page telling them to ask for one.
"""

from collections.abc import Callable
from functools import wraps

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from mistudio import roles


def reader_required(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """``login_required``, then the ``model:read`` role (403 with an explanation without it)."""

    @wraps(view)
    def with_role(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if not request.user.has_perm(roles.READ):
            return render(request, "frontend/no_role.html", status=403)
        return view(request, *args, **kwargs)

    return login_required(with_role)
