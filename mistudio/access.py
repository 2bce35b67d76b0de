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

**The whole object graph.** A row a request names may lead to others: an SAE to the cache it was
trained on, an analysis to the cache it read, a mean ablation to a cache, a steering vector to
its datasets. Every such row is checked against the caller with :func:`reach` — the same 404 as
asking for it directly — so a shared row never opens its owner's private ones; and a row's JSON
shows the id of a row behind it only to a viewer who may see that row (:func:`linked_id`).
Each app declares who sees its rows once (:func:`register_visibility`).

**A deleted user publishes nothing.** A row without an owner is a *system* row that every reader
sees, so a user's rows must never lose their owner: when a user is deleted
(:func:`withhold_rows_of_deleted_user`), rows others may build on (models, datasets, caches,
extractions, generations, SAEs, analyses, steering vectors, evaluations) go to the inactive
``deleted-users`` account and are unshared — visible to admins only, who may reassign or delete
them — and their personal notes (feature labels, ``OWNER_DELETED = "delete"``) are deleted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import PermissionDenied
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


# --- the object graph ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Visibility:
    rows_for: Callable[[Any], QuerySet]  # user -> the rows of the kind they may see
    code: str
    what: str


_VISIBILITY: dict[type[Model], _Visibility] = {}


class Audience:
    """The viewer of an event: whoever may receive events about the row it describes."""

    def __repr__(self) -> str:
        return "AUDIENCE"


AUDIENCE = Audience()


def register_visibility(
    model: type[Model], rows_for: Callable[[Any], QuerySet], *, code: str, what: str
) -> None:
    """Declare who may see rows of ``model`` (its selector's list for a user) and the 404 code a
    row out of sight answers with."""
    _VISIBILITY[model] = _Visibility(rows_for=rows_for, code=code, what=what)


def may_see(user, model: type[Model], pk: Any) -> bool:
    """Whether ``user`` may see row ``pk`` of ``model`` (a missing row: no)."""
    if pk is None:
        return False
    if user is OPERATOR or is_admin(user):
        return model.objects.filter(pk=pk).exists()
    if user is None or not user.is_authenticated:
        return False
    return _VISIBILITY[model].rows_for(user).filter(pk=pk).exists()


def reach(user, row: Model | None) -> Model:
    """``row``, reached through another row ``user`` asked for, if they may see it; 404 with its
    kind's code otherwise — the answer they get asking for it directly."""
    model = type(row) if row is not None else None
    if row is None or not may_see(user, model, row.pk):
        visibility = _VISIBILITY.get(model) if model is not None else None
        code, what = (visibility.code, visibility.what) if visibility else ("NOT_FOUND", "row")
        raise ApplicationError(code, f"No such {what}.", status=404)
    return row


def linked_id(viewer, holder: Model, model: type[Model], pk: Any) -> Any:
    """The id of row ``pk`` of ``model`` that ``holder`` leads to, as ``viewer`` is shown it: None
    when they may not see that row. For an event (``viewer`` is :data:`AUDIENCE`) the id is shown
    only when ``holder`` is private to an owner who may see it (a shared or system row's events
    reach everyone who sees it)."""
    if pk is None:
        return None
    if viewer is AUDIENCE:
        if getattr(holder, "shared", False) or holder.owner_id is None:
            return None
        viewer = holder.owner
    cache = holder.__dict__.setdefault("_linked_seen", {})
    key = (getattr(viewer, "pk", viewer), model, pk)
    if key not in cache:
        cache[key] = may_see(viewer, model, pk)
    return pk if cache[key] else None


# --- deleted users -------------------------------------------------------------------------------

DELETED_USERS_ACCOUNT = "deleted-users"


def deleted_users_account():
    """The inactive account that holds deleted users' rows (no role: only admins see its rows)."""
    from django.contrib.auth import get_user_model

    account, created = get_user_model().objects.get_or_create(
        username=DELETED_USERS_ACCOUNT, defaults={"is_active": False}
    )
    if created:
        account.set_unusable_password()
        account.save(update_fields=["password"])
    return account


def owned_models() -> list[type[Model]]:
    """Every model whose rows have an ``owner`` (a user)."""
    from django.apps import apps
    from django.conf import settings

    owned = []
    for model in apps.get_models():
        field = next((field for field in model._meta.fields if field.name == "owner"), None)
        if (
            field is not None
            and field.related_model is not None
            and (field.related_model._meta.label == settings.AUTH_USER_MODEL)
        ):
            owned.append(model)
    return owned


def withhold_rows_of_deleted_user(sender, instance, **kwargs) -> None:
    """pre_delete of a user: their rows go to the ``deleted-users`` account, unshared (or are
    deleted, for a model with ``OWNER_DELETED = "delete"``), before the owner field could be
    cleared — which would publish them as system rows. That account itself cannot be deleted
    while it holds rows (403)."""
    if instance.username == DELETED_USERS_ACCOUNT:
        if any(model._default_manager.filter(owner=instance).exists() for model in owned_models()):
            raise PermissionDenied(
                f"The {DELETED_USERS_ACCOUNT} account holds deleted users' rows: "
                "reassign or delete them first."
            )
        return
    account = deleted_users_account()
    for model in owned_models():
        rows = model._default_manager.filter(owner=instance)
        if getattr(model, "OWNER_DELETED", "withhold") == "delete":
            rows.delete()
            continue
        changes: dict[str, Any] = {"owner": account}
        if any(field.name == "shared" for field in model._meta.fields):
            changes["shared"] = False
        rows.update(**changes)
