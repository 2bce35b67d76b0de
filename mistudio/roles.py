"""Roles are Django groups named after the seed's permissions.

``model:read`` ⊂ ``model:write`` ⊂ ``model:admin``.
"""

from django.contrib.auth.models import Group, Permission

ROLE_PERMISSIONS: dict[str, list[str]] = {
    "model:read": ["model_read"],
    "model:write": ["model_read", "model_write"],
    "model:admin": ["model_read", "model_write", "model_admin"],
}
ROLES = tuple(ROLE_PERMISSIONS)
READ = "models_app.model_read"
WRITE = "models_app.model_write"
ADMIN = "models_app.model_admin"


def ensure_role_groups(**kwargs) -> None:
    """post_migrate: create the role groups with their permissions (idempotent)."""
    for role, codenames in ROLE_PERMISSIONS.items():
        group, _ = Group.objects.get_or_create(name=role)
        group.permissions.set(
            Permission.objects.filter(content_type__app_label="models_app", codename__in=codenames)
        )
