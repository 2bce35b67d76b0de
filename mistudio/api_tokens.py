"""A user's API tokens: several named ones (``ApiToken``), each made and revoked alone from the
account page, beside DRF's single ``Token`` (``manage.py create_user``), which keeps working. Keys are
shown once, when made. Every front door (DRF, the async /v1, WebSockets) reads a key through
:func:`user_of_key`."""

from datetime import timedelta

from django.db import transaction
from django.utils import timezone
from rest_framework.authtoken.models import Token

from mistudio.errors import ApplicationError
from mistudio.models import ApiToken
from mistudio.text import check_label_text

MAX_TOKENS_PER_USER = 20
LAST_USED_EVERY = timedelta(minutes=1)  # a token's last use is written at most this often


def user_of_key(key: str):
    """The active user a key names (DRF's token or a named one), or None; a named token's last use
    is noted (at most once a minute)."""
    token = Token.objects.select_related("user").filter(key=key).first()
    if token is not None:
        return token.user if token.user.is_active else None
    named = ApiToken.objects.select_related("user").filter(key=key).first()
    if named is None or not named.user.is_active:
        return None
    now = timezone.now()
    if named.last_used_at is None or now - named.last_used_at > LAST_USED_EVERY:
        ApiToken.objects.filter(pk=named.pk).update(last_used_at=now)
    return named.user


def api_token_of(user) -> Token | None:
    return Token.objects.filter(user=user).first()


def api_tokens_of(user) -> list[ApiToken]:
    return list(ApiToken.objects.filter(user=user))


@transaction.atomic
def api_token_create(user, *, replace: bool = True) -> str:
    """A new key for ``user``'s default token (the old one stops working at once); with
    ``replace=False`` the existing key is kept and returned."""
    if not replace:
        return Token.objects.get_or_create(user=user)[0].key
    Token.objects.filter(user=user).delete()
    return Token.objects.create(user=user).key


def named_token_create(user, *, name: str) -> ApiToken:
    """A new named token beside the user's others (none of them changes)."""
    name = name.strip()
    check_label_text(name, field="name")
    if not name:
        raise ApplicationError("INVALID_NAME", "Name the token (where it is used: a notebook, CI…).")
    if ApiToken.objects.filter(user=user, name=name).exists():
        raise ApplicationError("TOKEN_NAME_TAKEN", f"You already have a token named {name!r}.", status=409)
    if ApiToken.objects.filter(user=user).count() >= MAX_TOKENS_PER_USER:
        raise ApplicationError(
            "TOO_MANY_TOKENS", f"A user has at most {MAX_TOKENS_PER_USER} named tokens: revoke one first."
        )
    return ApiToken.objects.create(user=user, name=name)


def api_token_revoke(user, *, token_id: int | None = None) -> bool:
    """Delete the user's default key, or (``token_id``) one of their named tokens; True when there
    was one."""
    if token_id is not None:
        deleted, _ = ApiToken.objects.filter(user=user, pk=token_id).delete()
    else:
        deleted, _ = Token.objects.filter(user=user).delete()
    return bool(deleted)
