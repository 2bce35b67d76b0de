"""Page: the signed-in user's API tokens, for scripts, notebooks and the OpenAI-compatible ``/v1``
without ``manage.py create_user``: several named ones, each revoked alone, beside the default one."""

from django.contrib import messages
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from frontend.access import reader_required
from mistudio.api_tokens import (
    api_token_create,
    api_token_of,
    api_token_revoke,
    api_tokens_of,
    named_token_create,
)
from mistudio.errors import ApplicationError


@reader_required
@require_http_methods(["GET", "HEAD", "POST"])
def api_token_page(request):
    """GET: the user's tokens (names, dates; never a key). POST ``action=create``: a new default key
    (the one made before stops working); ``action=create_named`` with ``name``: one more token,
    beside the others; ``action=revoke`` (``token``: a named one's id, else the default): that one
    only. A new key is shown on its answer only."""
    new_key, new_name, error = None, None, None
    if request.method == "POST":
        action = request.POST.get("action")
        try:
            if action == "create":
                new_key = api_token_create(request.user)
            elif action == "create_named":
                made = named_token_create(request.user, name=request.POST.get("name", ""))
                new_key, new_name = made.key, made.name
            elif action == "revoke":
                token_id = request.POST.get("token", "").strip()
                if api_token_revoke(request.user, token_id=int(token_id) if token_id.isdigit() else None):
                    messages.success(request, "Revoked: requests that use that token now get 401.")
                return redirect("frontend:api-token")
            else:
                return render(request, "frontend/api_token.html", {"error": "Unknown action."}, status=400)
        except ApplicationError as refused:
            error = refused.message
    return render(
        request,
        "frontend/api_token.html",
        {
            "token": api_token_of(request.user),
            "named": api_tokens_of(request.user),
            "new_key": new_key,
            "new_name": new_name,
            "error": error,
            "api_base": request.build_absolute_uri("/"),
        },
        status=400 if error else 200,
    )
