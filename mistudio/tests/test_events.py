"""The WebSocket consumer on the full ASGI application, with the real Redis channel layer."""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from mistudio.asgi import application
from mistudio.events import ProgressThrottle, publish, rows_audience

pytestmark = pytest.mark.django_db(transaction=True)
ORIGIN = (b"origin", b"http://127.0.0.1:8000")
HOST = (b"host", b"127.0.0.1:8000")


def token_header(user) -> tuple[bytes, bytes]:
    return (b"authorization", f"Token {user.auth_token.key}".encode())


Connect = Callable[..., Awaitable[tuple[WebsocketCommunicator, bool, int | None]]]


@pytest.fixture
async def connect() -> AsyncIterator[Connect]:
    """Opens sockets on the full app, and ends every one before the test's event loop closes,
    refused ones included. A socket the server refused still has its application waiting in the
    channel layer's receive until the client disconnects, and cancelling that receive in the loop's
    teardown can hang in channels_redis: seen as an intermittent hang of this file in CI (as in
    test_websocket_limits.py)."""
    opened: list[WebsocketCommunicator] = []

    async def open_socket(*headers: tuple[bytes, bytes]) -> tuple[WebsocketCommunicator, bool, int | None]:
        communicator = WebsocketCommunicator(application, "/ws/events/", headers=[HOST, *headers])
        opened.append(communicator)
        connected, code = await communicator.connect()
        return communicator, connected, code

    yield open_socket
    for communicator in opened:
        if not communicator.future.done():  # not ended by the test, nor by a failure inside the app
            await communicator.disconnect()


async def test_anonymous_connections_are_refused(connect):
    _communicator, connected, code = await connect(ORIGIN)
    assert not connected
    assert code == 4401


async def test_foreign_origins_are_refused(reader, connect):
    _communicator, connected, _ = await connect((b"origin", b"http://evil.example"), token_header(reader))
    assert not connected


async def test_a_client_without_origin_cannot_ride_on_a_session_cookie(reader, connect):
    from django.test import Client

    browser = Client()
    await sync_to_async(browser.force_login)(reader)
    cookie = f"sessionid={browser.cookies['sessionid'].value}".encode()
    _, connected, code = await connect((b"cookie", cookie))
    assert not connected and code == 4401
    _, connected, _ = await connect(ORIGIN, (b"cookie", cookie))
    assert connected


async def test_subscribe_sends_a_snapshot_then_published_events(reader, connect, tiny_gpt2_folder):
    from models_app.services import model_publish, model_register

    model = await sync_to_async(model_register)(
        source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=None
    )
    communicator, connected, _ = await connect(ORIGIN, token_header(reader))
    assert connected
    await communicator.send_json_to({"action": "subscribe", "groups": ["models", f"model.{model.id}"]})
    first = await communicator.receive_json_from(timeout=5)
    second = await communicator.receive_json_from(timeout=5)
    assert first["type"] == "snapshot" and first["group"] == "models"
    assert [state["model_id"] for state in first["data"]["models"]] == [model.id]
    assert second == {
        "type": "snapshot",
        "group": f"model.{model.id}",
        "seq": second["seq"],  # the group's event count (mistudio/tests/test_websocket_limits.py)
        "data": second["data"],
    }
    assert second["data"]["status"] == "pending"

    def change_state():
        fields = model.mark_loading(progress=42, message="Loading weights")
        model_publish(model, "model:loading", fields)

    await sync_to_async(change_state)()
    events = [await communicator.receive_json_from(timeout=5) for _ in range(2)]
    assert {event["group"] for event in events} == {"models", f"model.{model.id}"}
    for event in events:
        assert event["event"] == "model:loading"
        assert event["data"]["progress"] == 42 and event["data"]["message"] == "Loading weights"
    # The row changed before the event went out.
    await sync_to_async(model.refresh_from_db)()
    assert model.status == "loading" and model.progress == 42


async def test_unknown_or_invisible_groups_are_refused(reader, connect):
    communicator, _, _ = await connect(ORIGIN, token_header(reader))
    await communicator.send_json_to(
        {"action": "subscribe", "groups": ["model.m_nosuchmodel", "secrets", "models.x"]}
    )
    replies = [await communicator.receive_json_from(timeout=5) for _ in range(3)]
    assert [reply["code"] for reply in replies] == ["UNKNOWN_GROUP"] * 3
    await sync_to_async(publish)(
        "model:ready",
        {"model_id": "m_nosuchmodel"},
        groups=["model.m_nosuchmodel"],
        audience=rows_audience(("model", "m_nosuchmodel")),
    )
    assert await communicator.receive_nothing(timeout=0.5)
    await communicator.send_json_to({"action": "dance"})
    assert (await communicator.receive_json_from(timeout=5))["code"] == "BAD_MESSAGE"


def test_progress_throttle_lets_through_one_percent_steps_and_the_final_event():
    throttle = ProgressThrottle(min_step=1.0, min_interval=3600)
    passed = [progress for progress in [0, 0.2, 0.5, 1.0, 1.4, 2.1, 2.2] if throttle.ready(progress)]
    assert passed == [0, 1.0, 2.1]
    assert throttle.ready(2.3, final=True)


async def test_the_shared_models_group_carries_a_private_model_to_its_owner_only(
    writer, reader, tiny_gpt2_folder, connect
):
    from models_app.services import model_register, model_update

    sockets = {}
    for user in (writer, reader):
        communicator, connected, _ = await connect(ORIGIN, token_header(user))
        assert connected
        await communicator.send_json_to({"action": "subscribe", "groups": ["models"]})
        assert (await communicator.receive_json_from(timeout=5))["type"] == "snapshot"
        sockets[user.username] = communicator

    model = await sync_to_async(model_register)(
        source="local", identifier=str(tiny_gpt2_folder), name="private-one", owner=writer
    )
    owners = await sockets[writer.username].receive_json_from(timeout=5)
    others = await sockets[reader.username].receive_json_from(timeout=5)
    assert owners["event"] == "model:registered" and owners["data"]["model_id"] == model.id
    # The reader learns only that the group moved on: no event name, no id, no data.
    assert others == {"type": "skip", "group": "models", "seq": owners["seq"]}

    await sync_to_async(model_update)(model_id=model.id, actor=writer, shared=True)  # now everyone may see it
    owners = await sockets[writer.username].receive_json_from(timeout=5)
    others = await sockets[reader.username].receive_json_from(timeout=5)
    assert others["event"] == owners["event"] == "model:updated"
    assert others["data"]["model_id"] == model.id and others["seq"] == owners["seq"]


async def test_an_event_is_sent_after_its_transaction_commits_so_a_rest_reread_sees_it(
    reader, client_for, tiny_gpt2_folder, connect
):
    """A page re-reads the row over REST on each event: it must find the state the event announced."""
    import time

    from django.db import connection, transaction

    from models_app.models import LanguageModel
    from models_app.services import model_publish, model_register

    model = await sync_to_async(model_register)(
        source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=None
    )
    communicator, connected, _ = await connect(ORIGIN, token_header(reader))
    assert connected
    await communicator.send_json_to({"action": "subscribe", "groups": [f"model.{model.id}"]})
    assert (await communicator.receive_json_from(timeout=5))["type"] == "snapshot"

    def change_slowly(progress: float, *, fail: bool = False):
        try:
            with transaction.atomic():
                row = LanguageModel.objects.select_for_update().get(pk=model.id)
                model_publish(row, "model:loading", row.mark_loading(progress=progress, message="Loading"))
                time.sleep(0.5)  # the transaction is still open: nobody else sees the change yet
                if fail:
                    raise RuntimeError("rolled back")
        except RuntimeError:
            pass
        finally:  # a thread of its own: its connection would outlive the test (and the test database)
            connection.close()

    api = await sync_to_async(client_for)(reader)
    for progress in (25.0, 75.0):
        changing = asyncio.ensure_future(sync_to_async(change_slowly, thread_sensitive=False)(progress))
        event = await communicator.receive_json_from(timeout=5)
        state = (await sync_to_async(api.get)(f"/api/models/{model.id}")).json()
        assert event["data"]["progress"] == state["progress"] == progress, (event["data"], state)
        await changing
    await sync_to_async(change_slowly, thread_sensitive=False)(99.0, fail=True)
    assert await communicator.receive_nothing(timeout=0.5)  # a rolled-back change announces nothing
