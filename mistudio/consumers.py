"""WebSocket consumer at ``/ws/events/``: authenticated subscriptions to event groups."""

import time
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from mistudio.access import may_receive
from mistudio.events import GROUP_KINDS, group_snapshot, parse_group
from mistudio.json_input import parse_json
from mistudio.websocket_auth import current_user

MAX_GROUPS_PER_CONNECTION = 100
# A subscribe message naming the most groups allowed fits easily; anything larger is not ours.
MAX_MESSAGE_BYTES = 4096
CLOSE_UNAUTHENTICATED = 4401
# RFC 6455's "Message Too Big" is 1009, but Daphne (autobahn) only sends 1000 or 3000 to 4999: so
# 4009, in the application range beside 4401.
CLOSE_MESSAGE_TOO_BIG = 4009
# How old a "this user may see that row" (or "this user is still signed in") may be when an event
# is relayed: unsharing, deleting, deactivating or revoking a token takes effect within this.
DECISION_SECONDS = 1.0


class EventsConsumer(AsyncJsonWebsocketConsumer):
    """Relays published events to a signed-in client.

    Client messages: ``{"action": "subscribe" | "unsubscribe", "groups": ["models", "model.m_…"]}``.
    Server messages: ``{"type": "snapshot", "group", "seq", "data"}`` once per subscription, then
    ``{"type": "event", "group", "event", "seq", "data"}`` where ``seq`` counts the group's events
    (a jump of more than one means some were missed: re-read the state over REST);
    ``{"type": "error", "code", "message"}`` for a bad request. Anonymous connections are refused
    (close code 4401); a client message over ``MAX_MESSAGE_BYTES`` gets an error
    ``MESSAGE_TOO_LARGE`` and the connection is closed with 4009.

    Each event is relayed only if, when it arrives, the socket is subscribed to its group, the user
    is still active (and their token, for a token-authenticated socket, still exists: else the
    socket is closed with 4401) and may see every row the event is about (else a ``skip``).
    """

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        self.subscriptions: set[str] = set()
        self.user, self.user_checked_at = user, time.monotonic()
        self.allowed_rows: dict[tuple[str, str], float] = {}  # row -> when it was last found visible
        await self.accept()

    async def disconnect(self, code: int) -> None:
        for group in getattr(self, "subscriptions", set()):
            await self.channel_layer.group_discard(group, self.channel_name)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs) -> None:
        """Size and shape checks before any JSON is parsed (the base class would crash on bad JSON)."""
        size = len(bytes_data or b"") if text_data is None else len(text_data)
        if size <= MAX_MESSAGE_BYTES and text_data is not None:
            size = len(text_data.encode())  # characters ≤ bytes: encode only what may fit
        if size > MAX_MESSAGE_BYTES:
            await self.send_error(
                "MESSAGE_TOO_LARGE", f"Client messages are limited to {MAX_MESSAGE_BYTES} bytes."
            )
            await self.close(code=CLOSE_MESSAGE_TOO_BIG)
            return
        try:
            content = parse_json(text_data) if text_data is not None else None
        except ValueError:
            content = None  # bad JSON, too deep, NaN: answered BAD_MESSAGE
        await self.receive_json(content)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        action = content.get("action") if isinstance(content, dict) else None
        groups = content.get("groups") if isinstance(content, dict) else None
        if action not in {"subscribe", "unsubscribe"} or not isinstance(groups, list):
            await self.send_error(
                "BAD_MESSAGE", 'Send {"action": "subscribe"|"unsubscribe", "groups": [...]}.'
            )
            return
        for group in groups:
            if action == "subscribe":
                await self.subscribe(group)
            elif group in self.subscriptions:
                self.subscriptions.discard(group)
                await self.channel_layer.group_discard(group, self.channel_name)

    async def subscribe(self, group: Any) -> None:
        parsed = parse_group(group) if isinstance(group, str) else None
        if parsed is None:
            await self.send_error("UNKNOWN_GROUP", f"Unknown group {str(group)[:100]!r}.")
            return
        if len(self.subscriptions) >= MAX_GROUPS_PER_CONNECTION:
            await self.send_error("TOO_MANY_GROUPS", f"At most {MAX_GROUPS_PER_CONNECTION} groups.")
            return
        kind, key = parsed
        # Join before reading the snapshot: an event published in between is then delivered
        # after the snapshot rather than lost.
        await self.channel_layer.group_add(group, self.channel_name)
        sequence, snapshot = await database_sync_to_async(group_snapshot)(
            kind=kind, user=self.user, key=key, group=group
        )
        if snapshot is None:
            await self.channel_layer.group_discard(group, self.channel_name)
            await self.send_error("UNKNOWN_GROUP", f"Unknown group {group!r}.")
            return
        self.subscriptions.add(group)
        await self.send_json({"type": "snapshot", "group": group, "seq": sequence, "data": snapshot})

    async def event_message(self, message: dict[str, Any]) -> None:
        group = message.get("group")
        if group not in self.subscriptions:
            return  # a subscription refused (or ended) while the event was on its way
        if not await self.still_signed_in():
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        if not await self.may_see(group, message.get("audience") or {}):
            # A row the user may not see (now): only the group's seq moves on, nothing about the row.
            await self.send_json({"type": "skip", "group": group, "seq": message.get("seq")})
            return
        await self.send_json(
            {
                "type": "event",
                "group": group,
                "event": message["event"],
                "seq": message.get("seq"),
                "data": message["data"],
            }
        )

    async def still_signed_in(self) -> bool:
        if time.monotonic() - self.user_checked_at >= DECISION_SECONDS:
            user = await database_sync_to_async(current_user)(self.scope)
            if user is None:
                return False
            self.user, self.user_checked_at = user, time.monotonic()
            self.allowed_rows.clear()  # a role may have changed too
        return True

    async def may_see(self, group: str, audience: dict[str, Any]) -> bool:
        """Whether the user may see every row the event is about: its group's and its audience's."""
        if "owner_id" in audience:  # a row that no longer exists: decided when it was published
            return may_receive(self.user, audience)
        kind, key = parse_group(group)
        rows = [(kind.name, key)] if kind.keyed else []
        rows += [(row_kind, row_key) for row_kind, row_key in audience.get("rows", [])]
        for row in rows:
            # A "yes" is kept for a second (a generation streams an event per token); a "no" is
            # asked again each time, so a row shared a moment ago reaches its new audience at once.
            if time.monotonic() - self.allowed_rows.get(row, float("-inf")) < DECISION_SECONDS:
                continue
            if not await database_sync_to_async(GROUP_KINDS[row[0]].visible)(self.user, row[1]):
                return False
            self.allowed_rows[row] = time.monotonic()
        return True

    async def send_error(self, code: str, message: str) -> None:
        await self.send_json({"type": "error", "code": code, "message": message})
