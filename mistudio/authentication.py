"""API authentication: DRF tokens, also accepted as ``Authorization: Bearer <token>``."""

from importlib import import_module

from django.conf import settings
from django.contrib.auth import SESSION_KEY, get_user_model
from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication

from mistudio.api_tokens import user_of_key
from mistudio.jobs import job_is_active


class ApiTokenAuthentication(TokenAuthentication):
    """``Authorization: Token <key>``: DRF's token or one of the user's named tokens
    (``mistudio.api_tokens.user_of_key``)."""

    def authenticate_credentials(self, key: str):
        user = user_of_key(key)
        if user is None:
            raise exceptions.AuthenticationFailed("Invalid token.")
        return user, key


class BearerTokenAuthentication(ApiTokenAuthentication):
    """The same API tokens as ``Authorization: Bearer <token>`` (what OpenAI clients send)."""

    keyword = "Bearer"


def token_key(authorization: str) -> str | None:
    """The key of ``Authorization: Token <key>`` or ``Bearer <key>``, else None."""
    keyword, _, key = authorization.partition(" ")
    key = key.strip()
    return key if keyword.lower() in {"token", "bearer"} and key else None


def signed_in(*, session_key: str | None, authorization: str | None) -> bool:
    """Whether the session cookie or the API token names an active user (database reads only)."""
    key = token_key(authorization or "")
    if key and user_of_key(key) is not None:
        return True
    if not session_key:
        return False
    session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    user_id = session.get(SESSION_KEY)
    return user_id is not None and get_user_model().objects.filter(pk=user_id, is_active=True).exists()


# --- job tokens ------------------------------------------------------------------------------------
# A job that calls this workbench's own /v1 (an explanation job's explainer) acts for its owner
# with a signed token that names the job: no key is stored or created for it, it opens the
# generation routes only (async_api), never the rest of the API, and it is valid only while its
# job is queued or running (the row is checked on every request; JOB_TOKEN_MAX_AGE bounds it too).
JOB_TOKEN_PREFIX = "mistudio-job."  # noqa: S105 (a marker, not a secret)
JOB_TOKEN_SALT = "mistudio.job-token"  # noqa: S105 (a namespace for signing)
JOB_TOKEN_REFUSED = "Invalid or expired job token."  # noqa: S105 (a message)


def job_token_for(row) -> str:
    """The token of a job row (a :class:`~mistudio.jobs.JobRow` with an owner) for its requests."""
    from django.core import signing

    return JOB_TOKEN_PREFIX + signing.dumps(
        {"user": row.owner_id, "kind": row.kind, "job": row.pk}, salt=JOB_TOKEN_SALT, compress=True
    )


class JobTokenAuthentication(BearerTokenAuthentication):
    """``Authorization: Bearer mistudio-job.…``: the owner of the job the token names, while that
    job is queued or running (``JOB_TOKEN_MAX_AGE`` at most)."""

    def authenticate_credentials(self, key: str):
        from django.core import signing
        from rest_framework import exceptions

        if not key.startswith(JOB_TOKEN_PREFIX):
            return None
        try:
            claims = signing.loads(
                key.removeprefix(JOB_TOKEN_PREFIX), salt=JOB_TOKEN_SALT, max_age=settings.JOB_TOKEN_MAX_AGE
            )
        except signing.BadSignature:
            raise exceptions.AuthenticationFailed(JOB_TOKEN_REFUSED) from None
        user = get_user_model().objects.filter(pk=claims.get("user"), is_active=True).first()
        if user is None or not job_is_active(kind=claims.get("kind"), job_id=claims.get("job"), owner=user):
            raise exceptions.AuthenticationFailed(JOB_TOKEN_REFUSED)
        return user, {"job": claims.get("job")}
