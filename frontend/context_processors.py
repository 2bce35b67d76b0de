"""Template context every page gets: the signed-in user's role, for the top bar."""

from mistudio import roles


def role_of(user) -> str:
    for role, permission in (
        ("model:admin", roles.ADMIN),
        ("model:write", roles.WRITE),
        ("model:read", roles.READ),
    ):
        if user.has_perm(permission):
            return role
    return "no role"


def user_role(request) -> dict[str, str]:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    return {"role": role_of(user), "can_write": user.has_perm(roles.WRITE)}
