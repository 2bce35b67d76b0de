"""Who may see and who may change a row: ownership and sharing, in one place.

Every selector and every changing service of models, datasets, extractions, caches and generations
goes through these functions, so the API, the pages, the WebSocket snapshots and the admin-facing
commands all answer the same way:

- ``model:admin`` sees and changes everything.
- Anyone else with ``model:read`` sees their own rows; of models and datasets also the ones marked
  ``shared`` and *system* ones (no owner: registered by ``manage.py`` commands, the demo); of caches
  also those their own extractions resolved to (a reused cache). Extraction jobs, caches and
  generations are otherwise private. A row they may not see does not exist for them: 404, never
  listed, never subscribable.
- Changing a row (rename, share, delete, unload, cancel) needs ``model:write`` and ownership (or
  ``model:admin``). Using a visible row (load a shared model, extract from a shared dataset,
  generate) needs ``model:write`` only: the result belongs to whoever asked.

A visible row the user may not change answers 403 ``NOT_OWNER``; an invisible one 404.
"""

from __future__ import annotations

from typing import Any

from django.db.models import Model, Q, QuerySet

from mistudio import roles
from mistudio.errors import ApplicationError


class Operator:
    """The person at the server: ``manage.py`` commands and Django admin staff. May change any row.

    Services that change a row take the ``actor`` they act for: a user (checked against the rules
    above) or ``OPERATOR``. The argument has no default, so no route can forget to pass its user.
    """

    def __repr__(self) -> str:
        return "OPERATOR"


OPERATOR = Operator()


def is_admin(user) -> bool:
    return bool(user is not None and user.is_authenticated and user.has_perm(roles.ADMIN))


def visible_rows(query: QuerySet, user, *, shareable: bool, also: Q | None = None) -> QuerySet:
    """The rows of ``query`` that ``user`` may see (see the module docstring); ``also`` names more
    rows a non-admin reader may see (the caches their own extractions reused). ``OPERATOR`` sees all."""
    if user is OPERATOR:
        return query
    if user is None or not user.is_authenticated or not user.has_perm(roles.READ):
        return query.none()
    if is_admin(user):
        return query
    visible = Q(owner=user) if not shareable else Q(owner=user) | Q(owner__isnull=True) | Q(shared=True)
    return query.filter(visible if also is None else visible | also)


def visible_row(rows: QuerySet, pk: str, *, code: str, what: str) -> Any:
    """Row ``pk`` of ``rows`` (already narrowed to what the user may see); 404 ``code`` otherwise,
    the same answer whether the row is missing or someone else's."""
    row = rows.filter(pk=pk).first()
    if row is None:
        raise ApplicationError(code, f"No such {what}.", status=404)
    return row


def completed_row(row: Any, *, code: str, what: str) -> Any:
    """``row`` when its status is ``completed``; 409 ``code`` naming its status otherwise."""
    if row.status != "completed":
        raise ApplicationError(code, f"The {what} is {row.status}.", status=409)
    return row


def may_change(row: Model, user) -> bool:
    return (
        user is OPERATOR
        or is_admin(user)
        or (
            user is not None
            and user.has_perm(roles.WRITE)
            and row.owner_id is not None
            and row.owner_id == user.pk
        )
    )


def check_may_change(row: Model, user, *, what: str) -> None:
    """Refuse a change to a row the user can see but does not own (403 ``NOT_OWNER``)."""
    if not may_change(row, user):
        raise ApplicationError(
            "NOT_OWNER",
            f"Only the owner of this {what} (or an admin) can change it.",
            status=403,
        )


def audience(row: Model, *, shareable: bool) -> dict[str, Any]:
    """Who may receive an event about ``row`` in a group many users share (the ``models`` group)."""
    return {"owner_id": row.owner_id, "shared": bool(getattr(row, "shared", False)) if shareable else False}


def may_receive(user, audience_of_event: dict[str, Any] | None) -> bool:
    """Whether an event with this audience may be relayed to ``user`` (no audience: everyone)."""
    if audience_of_event is None or is_admin(user):
        return True
    owner_id = audience_of_event.get("owner_id")
    return owner_id is None or owner_id == user.pk or bool(audience_of_event.get("shared"))
