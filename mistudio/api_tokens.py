"""A user's API token (one per user, DRF's ``Token``): made, replaced and revoked by its owner from
the account page, or by ``manage.py create_user``. The key is shown once, when it is made."""

from django.db import transaction
from rest_framework.authtoken.models import Token


def api_token_of(user) -> Token | None:
    return Token.objects.filter(user=user).first()


@transaction.atomic
def api_token_create(user, *, replace: bool = True) -> str:
    """A new key for ``user`` (the old one stops working at once); with ``replace=False`` the
    existing key is kept and returned."""
    if not replace:
        return Token.objects.get_or_create(user=user)[0].key
    Token.objects.filter(user=user).delete()
    return Token.objects.create(user=user).key


def api_token_revoke(user) -> bool:
    """Delete the user's key; True when there was one."""
    deleted, _ = Token.objects.filter(user=user).delete()
    return bool(deleted)
