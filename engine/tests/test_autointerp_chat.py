"""The explainer's chat client against a real HTTP server (a tiny one in this process, speaking the
OpenAI chat shape): a busy answer (429 or 503 with Retry-After, what this workbench's /v1 answers
beyond a user's share) is waited out and sent again rather than failing the feature; the waiting is
bounded and ends at once when the run is stopped; an endpoint that echoes the key does not get it
into an error."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine.autointerp.chat import ChatClient, ChatError, Stopped
from engine.autointerp.pipeline import Endpoints, FeatureExamples, InterpretationConfig, interpret_many
from engine.autointerp.prompts import Example

REPLY = {
    "choices": [{"message": {"role": "assistant", "content": "Explanation: the word cat"}}],
    "usage": {"prompt_tokens": 7, "completion_tokens": 5},
}


class Endpoint:
    """Answers each request with the next of ``script`` ((status, headers, body)), then 200s."""

    def __init__(self, script: list[tuple[int, dict[str, str], dict]]):
        self.script, self.times, self.lock = list(script), [], threading.Lock()

    def answer(self) -> tuple[int, dict[str, str], dict]:
        with self.lock:
            self.times.append(time.monotonic())
            return self.script.pop(0) if self.script else (200, {}, REPLY)


@contextmanager
def serving(endpoint: Endpoint) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            status, headers, body = endpoint.answer()
            payload = json.dumps(body).encode()
            self.send_response(status)
            for name, value in {"content-type": "application/json", **headers}.items():
                self.send_header(name, value)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def busy(status: int = 429, seconds: str = "0.2") -> tuple[int, dict[str, str], dict]:
    code = "RATE_LIMITED" if status == 429 else "MODEL_BUSY"
    return status, {"retry-after": seconds}, {"error": {"message": "Over your share.", "code": code}}


MESSAGES = [{"role": "user", "content": "Explain."}]


def test_busy_answers_are_waited_out_and_retried_beyond_the_failure_retries():
    """Six busy answers (more than the four retries a failure gets), then the reply: each retry
    waits the Retry-After it was given."""
    endpoint = Endpoint([busy(429), busy(503), busy(429), busy(429), busy(503), busy(429)])
    with serving(endpoint) as url, ChatClient(base_url=url, model="m", retries=4, backoff=0.01) as client:
        reply = client.complete(MESSAGES, max_tokens=8)
    assert reply.text == "Explanation: the word cat" and reply.completion_tokens == 5
    gaps = [later - earlier for earlier, later in zip(endpoint.times, endpoint.times[1:], strict=False)]
    assert len(gaps) == 6 and min(gaps) >= 0.19  # Retry-After, not the 0.01 s backoff
    assert client.usage.as_dict() == {
        "requests": 7, "retries": 6, "failures": 0, "prompt_tokens": 7, "completion_tokens": 5,
    }  # fmt: skip


def test_a_failure_without_retry_after_still_gets_only_its_retries():
    endpoint = Endpoint([(500, {}, {"error": {"message": "boom"}})] * 3)
    with (
        serving(endpoint) as url,
        ChatClient(base_url=url, model="m", retries=2, backoff=0.01) as client,
        pytest.raises(ChatError) as failed,
    ):
        client.complete(MESSAGES, max_tokens=8)
    assert failed.value.code == "ENDPOINT_ERROR" and len(endpoint.times) == 3


def test_waiting_is_bounded():
    endpoint = Endpoint([busy(429, "0.1")] * 100)
    with (
        serving(endpoint) as url,
        ChatClient(base_url=url, model="m", backoff=0.01, busy_wait=0.35) as client,
        pytest.raises(ChatError) as failed,
    ):
        client.complete(MESSAGES, max_tokens=8)
    assert failed.value.code == "ENDPOINT_BUSY" and failed.value.details == {"status": 429}
    assert "Over your share." in failed.value.message
    assert len(endpoint.times) == 4  # three waits of 0.1 s fit in 0.35 s


def test_stopping_ends_a_wait_at_once():
    endpoint = Endpoint([busy(429, "30")] * 10)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with serving(endpoint) as url, ChatClient(base_url=url, model="m") as client, pytest.raises(Stopped):
        client.complete(MESSAGES, max_tokens=8, stop=stop)
    assert time.monotonic() - started < 5 and len(endpoint.times) == 1


def test_a_run_on_a_busy_endpoint_explains_every_feature_and_stops_promptly_when_asked():
    """The pipeline: features whose requests are refused as busy for a while are explained, not
    failed; a run stopped while its requests wait on Retry-After ends within a tick."""
    config = InterpretationConfig(scorers=(), concurrency=2)
    features = [
        FeatureExamples(index=index, train=[Example(tokens=("a", "cat"), values=(0.0, 1.0))], test=[],
                        non_activating=[])
        for index in range(3)
    ]  # fmt: skip
    endpoint = Endpoint([busy(429, "0.05")] * 8)
    results = []
    with serving(endpoint) as url, ChatClient(base_url=url, model="m", retries=1, backoff=0.01) as client:
        assert interpret_many(features, Endpoints(client, client), config, on_result=results.append)
    assert sorted(result.index for result in results) == [0, 1, 2]
    assert [result.error_code for result in results] == ["", "", ""] and all(r.explanation for r in results)

    endpoint = Endpoint([busy(429, "30")] * 10)
    asked = time.monotonic() + 0.3
    with serving(endpoint) as url, ChatClient(base_url=url, model="m") as client:
        done = interpret_many(
            features, Endpoints(client, client), config, on_result=results.append,
            tick=lambda: time.monotonic() > asked,
        )  # fmt: skip
    assert done is False and time.monotonic() - asked < 5


def test_an_endpoint_that_echoes_the_key_does_not_get_it_into_the_error():
    key = "sk-proj-0123456789abcdefghij"
    endpoint = Endpoint([(401, {}, {"error": {"message": f"Incorrect API key provided: {key}."}})])
    with (
        serving(endpoint) as url,
        ChatClient(base_url=url, model="m", api_key=key) as client,
        pytest.raises(ChatError) as failed,
    ):
        client.complete(MESSAGES, max_tokens=8)
    assert key not in failed.value.message and "[redacted]" in failed.value.message


def test_prompt_logprobs_are_asked_for_by_vllms_name_and_an_answer_without_them_is_an_error():
    """The simulation scorer's request: busy answers are waited out as for a reply; an endpoint that
    ignores vLLM's prompt_logprobs (OpenAI's own) answers a plain completion: a clear error."""
    entries = [None, {"5": {"logprob": -0.5, "rank": 1, "decoded_token": "\t"}}]
    answer = {**REPLY, "prompt_token_ids": [1, 5], "prompt_logprobs": entries}
    endpoint = Endpoint([busy(429), (200, {}, answer), (200, {}, REPLY)])
    with serving(endpoint) as url, ChatClient(base_url=url, model="m", retries=0, backoff=0.01) as client:
        assert client.prompt_logprobs(MESSAGES, 15) == ([1, 5], entries)
        with pytest.raises(ChatError) as failed:
            client.prompt_logprobs(MESSAGES, 15)
    assert failed.value.code == "ENDPOINT_ERROR" and "prompt_logprobs" in failed.value.message
    assert client.usage.as_dict() == {
        "requests": 3, "retries": 1, "failures": 1, "prompt_tokens": 7, "completion_tokens": 5,
    }  # fmt: skip
