"""Page: the signed-in user's API token (make, replace, revoke), for scripts, notebooks and the
OpenAI-compatible ``/v1`` without ``manage.py create_user``."""

from django.contrib import messages
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from frontend.access import reader_required
from mistudio.api_tokens import api_token_create, api_token_of, api_token_revoke


@reader_required
@require_http_methods(["GET", "HEAD", "POST"])
def api_token_page(request):
    """GET: whether the user has a key (never the key itself). POST ``action=create``: a new key,
    shown on this answer only (a key made before stops working); ``action=revoke``: no key."""
    new_key = None
    if request.method == "POST":
        action = request.POST.get("action")
        if action == "create":
            new_key = api_token_create(request.user)
        elif action == "revoke":
            if api_token_revoke(request.user):
                messages.success(request, "Your API token was revoked; requests that use it now get 401.")
            return redirect("frontend:api-token")
        else:
            return render(request, "frontend/api_token.html", {"error": "Unknown action."}, status=400)
    token = api_token_of(request.user)
    return render(
        request,
        "frontend/api_token.html",
        {"token": token, "new_key": new_key, "api_base": request.build_absolute_uri("/")},
    )
