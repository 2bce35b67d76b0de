"""``POST /api/generate`` with ``"stream": true``: server-sent events on a real Daphne + worker.

The tiny models have random weights, so the tests check agreement: the streamed tokens against
the final result, a greedy stream against the greedy non-streamed answer, the stream against the
stored row.
"""

import json
import time

import httpx2 as httpx  # the HTTP client the openai package is built on
import pytest
from django.middleware.csrf import get_token
from django.test import Client

from generation.models import Generation, storable_text

pytestmark = pytest.mark.django_db(transaction=True)

PROMPT = "The river runs down to the sea, and the"


def events_of(response) -> list[dict]:
    return [
        json.loads(line.removeprefix("data: ")) for line in response.iter_lines() if line.startswith("data: ")
    ]


def stream(stack, body: dict) -> tuple[httpx.Response, list[dict]]:
    with httpx.stream(
        "POST", f"{stack.api}/generate", headers=stack.headers(), json={**body, "stream": True}, timeout=120
    ) as response:
        if response.status_code != 200:
            response.read()
            return response, []
        return response, events_of(response)


def whole(stack, body: dict) -> dict:
    response = httpx.post(f"{stack.api}/generate", headers=stack.headers(), json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_stream_takes_one_prompt(client, writer):
    client.force_login(writer)
    response = client.post(
        "/api/generate",
        {"model_id": "m_x", "prompt": ["one", "two"], "stream": True},
        content_type="application/json",
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "VALIDATION_ERROR" and list(error["details"]["fields"]) == ["prompt"]
    assert Generation.objects.count() == 0


def test_a_signed_in_browser_needs_the_csrf_header(writer):
    # As the playground sends it: session cookie, JSON body, X-CSRFToken (Django's test client
    # skips CSRF checks unless asked to enforce them).
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(writer)
    token = get_token(browser.get("/playground/").wsgi_request)
    body = {"model_id": "m_x", "prompt": ["one", "two"], "stream": True}
    forged = browser.post("/api/generate", body, content_type="application/json")
    assert forged.status_code == 403 and "CSRF" in forged.json()["error"]["message"]
    checked = browser.post("/api/generate", body, content_type="application/json", HTTP_X_CSRFTOKEN=token)
    assert checked.status_code == 400 and "prompt" in checked.json()["error"]["details"]["fields"]


@pytest.mark.slow
def test_streamed_tokens_add_up_to_the_result_and_match_the_whole_answer(live_stack):
    body = {"model_id": live_stack.models["gpt2"], "prompt": PROMPT, "temperature": 0, "max_tokens": 24}
    response, events = stream(live_stack, body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"

    started, *tokens, done = events
    assert started["type"] == "started" and started["request_id"].startswith("gen_")
    assert {event["type"] for event in tokens} == {"token"} and done["type"] == "done"
    assert done["request_id"] == started["request_id"]
    assert started["input_token_ids"] == done["input_token_ids"]
    assert "".join(event["text"] for event in tokens) == done["output_text"]
    assert len(tokens) == done["usage"]["completion_tokens"] >= 1
    assert [event["token_id"] for event in tokens] == done["output_token_ids"]
    assert [event["index"] for event in tokens] == list(range(len(tokens)))

    # Greedy: the same request without stream answers the same, in the same body.
    answer = whole(live_stack, body)
    assert {key: value for key, value in done.items() if key not in ("type", "request_id", "timings")} == {
        key: value for key, value in answer.items() if key not in ("request_id", "timings")
    }
    row = Generation.objects.get(pk=done["request_id"])
    assert row.status == "completed" and row.interface == "api"
    assert row.output_text == storable_text(done["output_text"])

    # A stop string: the streamed texts still add up to the output, which ends before the stop.
    stop = done["output_text"][len(done["output_text"]) // 2 :][:3]
    _, events = stream(live_stack, {**body, "stop": [stop]})
    *tokens, stopped = events[1:]
    assert stopped["finish_reason"] == "stop" and stop not in stopped["output_text"]
    assert done["output_text"].startswith(stopped["output_text"])
    assert "".join(event["text"] for event in tokens) == stopped["output_text"]
    assert len(tokens) == stopped["usage"]["completion_tokens"]


@pytest.mark.slow
def test_a_chat_stream_with_capture_ends_with_the_activations(live_stack):
    hook = "blocks.1.mlp.hook_post"
    body = {
        "model_id": live_stack.models["llama"],
        "messages": [{"role": "user", "content": "Name a river."}],
        "system_prompt": "You answer briefly.",
        "temperature": 0,
        "max_tokens": 8,
        "ignore_eos": True,
        "mistudio": {"capture": [hook]},
    }
    response, events = stream(live_stack, body)
    assert response.status_code == 200
    done = events[-1]
    assert done["type"] == "done" and len(events) == 2 + 8
    tokens = len(done["input_token_ids"]) + len(done["output_token_ids"])
    assert done["activations"]["shapes"][hook][0] == tokens
    cache = httpx.get(f"{live_stack.api}/activation-caches/{done['activations']['cache_id']}",
                      headers=live_stack.headers())  # fmt: skip
    assert cache.status_code == 200 and cache.json()["status"] == "completed"


@pytest.mark.slow
def test_an_error_before_the_first_token_is_a_plain_http_error(live_stack):
    response, events = stream(
        live_stack, {"model_id": live_stack.models["gpt2"], "prompt": "word " * 400, "temperature": 0}
    )
    assert response.status_code == 400 and events == []
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == "CONTEXT_LENGTH_EXCEEDED"


@pytest.mark.slow
def test_a_client_that_disconnects_mid_stream_cancels_the_generation(live_stack):
    # ignore_eos keeps the random model going: left alone, 2,000 tokens take seconds, so a stop that
    # works lands long before the end.
    body = {
        "model_id": live_stack.models["llama"], "prompt": "Keep talking", "max_tokens": 2000,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    seen = []
    with httpx.stream(
        "POST", f"{live_stack.api}/generate", headers=live_stack.headers(), json=body, timeout=60
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                seen.append(json.loads(line.removeprefix("data: ")))
            if len(seen) == 3:  # started and two tokens
                break
    assert [event["type"] for event in seen] == ["started", "token", "token"]

    generation = Generation.objects.get(pk=seen[0]["request_id"])
    deadline = time.monotonic() + 15
    while generation.status in Generation.ACTIVE and time.monotonic() < deadline:
        time.sleep(0.1)
        generation.refresh_from_db()
    assert generation.status == Generation.Status.CANCELLED, (generation.status, generation.completion_tokens)
    assert generation.finish_reason == "cancelled" and generation.completion_tokens < 1000
