"""DRF permission classes for the three roles."""

from rest_framework.permissions import BasePermission

from mistudio import roles


class CanRead(BasePermission):
    """model:read — any role. Unauthenticated requests fail authentication first (401)."""

    def has_permission(self, request, view) -> bool:
        return bool(request.user and request.user.is_authenticated and request.user.has_perm(roles.READ))


class CanWrite(BasePermission):
    """model:write for changing requests, model:read for reading ones."""

    def has_permission(self, request, view) -> bool:
        user = request.user
        if not (user and user.is_authenticated):
            return False
        needed = roles.READ if request.method in {"GET", "HEAD", "OPTIONS"} else roles.WRITE
        return user.has_perm(needed)
