"""WebSocket routes."""

from django.urls import path

from mistudio.consumers import EventsConsumer

websocket_urlpatterns = [path("ws/events/", EventsConsumer.as_asgi())]
