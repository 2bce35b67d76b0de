"""The event bus: save state to the row first, then publish it to channel-layer groups.

Every event miStudio emits goes through ``publish``, from synchronous code (RQ jobs, services).
A browser that subscribes to a group first gets a *snapshot* of the current state from the
group's registered snapshot function, so a page opened mid-job is correct; events follow.

Each group has a sequence number in Redis, incremented once per event sent to it (by whichever
process publishes). Every event carries its ``seq`` and a snapshot carries the ``seq`` it is at
least as new as, so a client that sees ``seq`` jump by more than one knows it missed an event
(the channel layer drops messages to a full channel, and group membership expires) and
re-reads that state over the REST API.

Groups: ``models``, ``model.<id>``, ``extraction.<id>``, ``generation.<id>``.

Every event names its audience: the rows it is about (``rows_audience``), besides the row of the
keyed group it is sent to. The consumer relays an event only to a user who may see every one of
those rows *when it is sent* (checked against the database, at most a second old), so unsharing
or deleting a row, or removing a user, takes effect on sockets already open. An event about a row
that no longer exists (a deletion) carries the audience frozen at publish time instead
(``{"owner_id", "shared"}``).
"""

import asyncio
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import models, transaction
from django.utils import timezone

from mistudio.redis_client import get_redis

logger = logging.getLogger(__name__)

# A snapshot function gets (user, key) — key is the part after "<kind>." or None — and returns the
# current state as JSON-ready data, or None when the group does not exist or the user may not see it.
SnapshotFunction = Callable[[Any, str | None], dict[str, Any] | None]
# Whether the user may see the row ``key`` of a keyed kind (an event about it may reach them).
VisibleFunction = Callable[[Any, str], bool]


@dataclass(frozen=True)
class GroupKind:
    name: str
    keyed: bool
    snapshot: SnapshotFunction
    visible: VisibleFunction | None = None


GROUP_KINDS: dict[str, GroupKind] = {}
# A row id as miStudio makes them (``m_…``, ``ext_…``): also what the channel layer accepts in a name.
GROUP_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}")


def register_group_kind(
    name: str, *, keyed: bool, snapshot: SnapshotFunction, visible: VisibleFunction | None = None
) -> None:
    """Declare a group family (``models`` unkeyed; ``model`` keyed by id, with who may see a row)."""
    if keyed and visible is None:
        raise ValueError(f"The keyed group kind {name!r} needs a visibility rule.")
    GROUP_KINDS[name] = GroupKind(name=name, keyed=keyed, snapshot=snapshot, visible=visible)


def parse_group(group: str) -> tuple[GroupKind, str | None] | None:
    """The kind and key of a group name, or None for anything that is not one of ours."""
    kind_name, _, key = group.partition(".")
    kind = GROUP_KINDS.get(kind_name)
    if kind is None or kind.keyed != bool(key) or (key and not GROUP_KEY.fullmatch(key)):
        return None
    return kind, key or None


def rows_audience(*rows: tuple[str, str]) -> dict[str, Any]:
    """The audience of an event about these rows (``("model", id)``, ``("extraction", id)``, …)."""
    return {"rows": [[kind, key] for kind, key in rows]}


# A group's counter outlives any page that could still be watching it; every event renews it.
SEQUENCE_TTL_SECONDS = 30 * 24 * 3600


def sequence_key(group: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}:events:seq:{group}"


def next_sequence(group: str) -> int:
    """The group's next event number: 1, 2, 3, … (Redis ``INCR``, shared by every process)."""
    key = sequence_key(group)
    pipeline = get_redis().pipeline()
    pipeline.incr(key)
    pipeline.expire(key, SEQUENCE_TTL_SECONDS)
    number, _ = pipeline.execute()
    return int(number)


def current_sequence(group: str) -> int:
    """The number of the group's last event (0 before the first)."""
    return int(get_redis().get(sequence_key(group)) or 0)


def group_snapshot(
    *, kind: GroupKind, user: Any, key: str | None, group: str
) -> tuple[int, dict[str, Any] | None]:
    """``(seq, snapshot)`` for a subscriber: the sequence is read first, so the state is at least
    as new as every event up to ``seq`` (the row is saved before its event is numbered)."""
    sequence = current_sequence(group)
    return sequence, kind.snapshot(user, key)


def timestamp() -> str:
    return timezone.now().isoformat().replace("+00:00", "Z")


def event_message(event: str, data: dict[str, Any], *, audience: dict[str, Any]) -> dict:
    """The channel-layer message of one event (both publishers send this shape; the consumer reads it)."""
    return {
        "type": "event.message",
        "event": event,
        "data": {**data, "timestamp": timestamp()},
        "audience": audience,
    }


def publish(
    event: str,
    data: dict[str, Any],
    *,
    groups: Iterable[str],
    instance: models.Model | None = None,
    fields: Iterable[str] = (),
    audience: dict[str, Any],
) -> None:
    """Save ``fields`` of ``instance`` (the row is the truth), then send ``event`` to ``groups``.

    With no ``fields`` nothing is saved (e.g. the event of a row just created). ``audience`` says
    which rows the event is about (``rows_audience``; see the module docstring): the consumer relays
    it only to users who may see them when it is sent, so a group many users share (``models``,
    ``model.<id>`` of a shared model) never carries another user's private row.

    The event is sent once the surrounding transaction commits (at once outside one), so a client
    that re-reads the row over REST on an event always sees the state the event announced; a rolled
    back change announces nothing. Call from synchronous code only. A channel-layer failure is
    logged, never raised: the row already holds the state, and pages recover it over REST.
    """
    update_fields = list(fields)
    if instance is not None and update_fields:
        if any(field.name == "updated_at" for field in instance._meta.fields):
            update_fields.append("updated_at")
        instance.save(update_fields=update_fields)
    message = event_message(event, data, audience=audience)
    groups = list(groups)
    transaction.on_commit(lambda: send_now(message, groups))


def send_now(message: dict[str, Any], groups: list[str]) -> None:
    layer = get_channel_layer()
    for group in groups:
        try:
            message_for_group = {**message, "group": group, "seq": next_sequence(group)}
            async_to_sync(layer.group_send)(group, message_for_group)
        except Exception:
            logger.warning("could not publish %s to %s", message["event"], group, exc_info=True)


class ProgressThrottle:
    """Lets a progress event through when it moved ≥ ``min_step`` percent or ``min_interval`` s passed."""

    def __init__(self, *, min_step: float = 1.0, min_interval: float = 0.5):
        self.min_step = min_step
        self.min_interval = min_interval
        self._last_progress: float | None = None
        self._last_time = 0.0

    def ready(self, progress: float, *, final: bool = False) -> bool:
        now = time.monotonic()
        if (
            final
            or self._last_progress is None
            or progress - self._last_progress >= self.min_step
            or now - self._last_time >= self.min_interval
        ):
            self._last_progress, self._last_time = progress, now
            return True
        return False


class BackgroundPublisher:
    """Sends events from a daemon thread with its own event loop, in the order they were given.

    For hot loops (a generation streams a token every few milliseconds): :meth:`send` only puts
    the event on a queue, so the loop never waits on the channel layer, and the thread's one
    event loop keeps its channel-layer connections instead of opening new ones per event.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending = 0
        self._idle = threading.Condition(self._lock)

    def send(
        self, event: str, data: dict[str, Any], *, groups: Iterable[str], audience: dict[str, Any]
    ) -> None:
        message = event_message(event, data, audience=audience)
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="event-publisher", daemon=True)
                self._thread.start()
            self._pending += 1
        self._queue.put((message, list(groups)))

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every event given so far is sent (tests, and before a worker exits)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout=timeout)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        layer = get_channel_layer()
        while True:
            message, groups = self._queue.get()
            for group in groups:
                try:
                    message_for_group = {**message, "group": group, "seq": next_sequence(group)}
                    loop.run_until_complete(layer.group_send(group, message_for_group))
                except Exception:
                    logger.warning("could not publish %s to %s", message["event"], group, exc_info=True)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()


BACKGROUND_PUBLISHER = BackgroundPublisher()
