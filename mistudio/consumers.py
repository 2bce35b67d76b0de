"""WebSocket consumer at ``/ws/events/``: authenticated subscriptions to event groups."""

from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from mistudio.events import parse_group

MAX_GROUPS_PER_CONNECTION = 100
CLOSE_UNAUTHENTICATED = 4401


class EventsConsumer(AsyncJsonWebsocketConsumer):
    """Relays published events to a signed-in client.

    Client messages: ``{"action": "subscribe" | "unsubscribe", "groups": ["models", "model.m_…"]}``.
    Server messages: ``{"type": "snapshot", "group", "data"}`` once per subscription, then
    ``{"type": "event", "group", "event", "data"}``; ``{"type": "error", "code", "message"}``
    for a bad request. Anonymous connections are refused (close code 4401).
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
        snapshot = await database_sync_to_async(kind.snapshot)(self.scope["user"], key)
        if snapshot is None:
            await self.channel_layer.group_discard(group, self.channel_name)
            await self.send_error("UNKNOWN_GROUP", f"Unknown group {group!r}.")
            return
        self.subscriptions.add(group)
        await self.send_json({"type": "snapshot", "group": group, "data": snapshot})

    async def event_message(self, message: dict[str, Any]) -> None:
        await self.send_json(
            {"type": "event", "group": message["group"], "event": message["event"], "data": message["data"]}
        )

    async def send_error(self, code: str, message: str) -> None:
        await self.send_json({"type": "error", "code": code, "message": message})
