"""WebSocket consumer at ``/ws/events/``: authenticated subscriptions to event groups."""

from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from mistudio.events import group_snapshot, parse_group
from models_app.access import may_receive

MAX_GROUPS_PER_CONNECTION = 100
# A subscribe message naming the most groups allowed fits easily; anything larger is not ours.
MAX_MESSAGE_BYTES = 4096
CLOSE_UNAUTHENTICATED = 4401
# RFC 6455's "Message Too Big" is 1009, but Daphne (autobahn) only sends 1000 or 3000 to 4999: so
# 4009, in the application range beside 4401.
CLOSE_MESSAGE_TOO_BIG = 4009


class EventsConsumer(AsyncJsonWebsocketConsumer):
    """Relays published events to a signed-in client.

    Client messages: ``{"action": "subscribe" | "unsubscribe", "groups": ["models", "model.m_…"]}``.
    Server messages: ``{"type": "snapshot", "group", "seq", "data"}`` once per subscription, then
    ``{"type": "event", "group", "event", "seq", "data"}`` where ``seq`` counts the group's events
    (a jump of more than one means some were missed: re-read the state over REST);
    ``{"type": "error", "code", "message"}`` for a bad request. Anonymous connections are refused
    (close code 4401); a client message over ``MAX_MESSAGE_BYTES`` gets an error
    ``MESSAGE_TOO_LARGE`` and the connection is closed with 4009.
    """

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        self.subscriptions: set[str] = set()
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
            content = await self.decode_json(text_data) if text_data is not None else None
        except ValueError:
            content = None
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
            kind=kind, user=self.scope["user"], key=key, group=group
        )
        if snapshot is None:
            await self.channel_layer.group_discard(group, self.channel_name)
            await self.send_error("UNKNOWN_GROUP", f"Unknown group {group!r}.")
            return
        self.subscriptions.add(group)
        await self.send_json({"type": "snapshot", "group": group, "seq": sequence, "data": snapshot})

    async def event_message(self, message: dict[str, Any]) -> None:
        if not may_receive(self.scope["user"], message.get("audience")):
            # Another user's private row: only the group's seq moves on, nothing about the row.
            await self.send_json({"type": "skip", "group": message["group"], "seq": message.get("seq")})
            return
        await self.send_json(
            {
                "type": "event",
                "group": message["group"],
                "event": message["event"],
                "seq": message.get("seq"),
                "data": message["data"],
            }
        )

    async def send_error(self, code: str, message: str) -> None:
        await self.send_json({"type": "error", "code": code, "message": message})
