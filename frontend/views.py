"""Server-rendered pages: plain function views over the same selectors the API uses."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from activations.selectors import dataset_list
from mistudio.health import redis_and_workers_status
from models_app import roles
from models_app.selectors import model_list


def role_of(user) -> str:
    for role, permission in (
        ("model:admin", roles.ADMIN),
        ("model:write", roles.WRITE),
        ("model:read", roles.READ),
    ):
        if user.has_perm(permission):
            return role
    return "no role"


@login_required
def home(request):
    redis_status, workers = redis_and_workers_status()
    return render(
        request,
        "frontend/home.html",
        {
            "models": model_list(user=request.user),
            "datasets": dataset_list(user=request.user)[:20],
            "workers": workers,
            "redis_ok": redis_status["ok"],
            "role": role_of(request.user),
        },
    )
