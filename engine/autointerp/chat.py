"""An OpenAI-compatible chat client for explainers and scorers.

One ``POST {base_url}/chat/completions`` per call, from any number of threads (one pooled
``httpx.Client``). Transient failures (no connection, a timeout, 429, 5xx) are retried with
exponential backoff, honouring ``Retry-After``; anything else is a :class:`ChatError` at once.

A *busy* answer (429 or 503 with ``Retry-After``: a rate limit or a full server, such as this
workbench's ``/v1`` refusing work beyond its owner's share) is not a failure: the request is sent
again after the delay it names, for up to ``busy_wait`` seconds in all, apart from the retries of
failures. A caller's ``stop`` event ends such a wait at once (:class:`Stopped`).

The key is sent in the ``Authorization`` header and nowhere else: never logged, never in an error
(an endpoint that echoes it back has it replaced in the error's text).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from engine.errors import EngineError

RETRIED_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
BUSY_STATUSES = frozenset({429, 503})  # with Retry-After: come back later, nothing is wrong
MAX_RETRY_AFTER_SECONDS = 30.0
BUSY_WAIT_SECONDS = 600.0
REDACTED = "[redacted]"


class ChatError(EngineError):
    """A request that failed for good: ``ENDPOINT_UNREACHABLE`` (after its retries),
    ``ENDPOINT_ERROR`` (a status it was not worth retrying, or still failing after its retries),
    ``ENDPOINT_BUSY`` (still busy after ``busy_wait`` seconds of waiting)."""


class Stopped(Exception):
    """The caller asked to stop (between two requests, or while a request waited to be retried)."""


@dataclass(frozen=True)
class ChatReply:
    text: str
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Usage:
    """What a client has spent, counted across its threads."""

    requests: int = 0
    retries: int = 0
    failures: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {
                "requests": self.requests,
                "retries": self.retries,
                "failures": self.failures,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
            }


class ChatClient:
    """Chat completions from ``model`` at ``base_url`` (the part before ``/chat/completions``,
    e.g. ``https://api.openai.com/v1``)."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout: float = 120.0,
        retries: int = 4,
        backoff: float = 0.5,
        connections: int = 32,
        busy_wait: float = BUSY_WAIT_SECONDS,
    ) -> None:
        self.model = model
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.retries, self.backoff, self.busy_wait = retries, backoff, busy_wait
        self._key = api_key
        self.usage = Usage()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            follow_redirects=False,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ChatClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def complete(
        self,
        messages: list[dict[str, str]],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        extra: dict[str, Any] | None = None,
        stop: threading.Event | None = None,
    ) -> ChatReply:
        """The reply's text and token counts (``extra``: more fields of the request body, such as an
        endpoint's extensions); raises :class:`ChatError`, or :class:`Stopped` once ``stop`` is set
        while it waits to send the request again."""
        return self._reply(self._answer(self._body(messages, max_tokens, temperature, extra), stop))

    def prompt_logprobs(
        self, messages: list[dict[str, str]], count: int, *, stop: threading.Event | None = None
    ) -> tuple[list[int], list[dict[str, Any] | None]]:
        """The templated prompt's token ids and, at each, vLLM's ``prompt_logprobs`` entry (``count``
        alternatives; None for the first token), from an endpoint that serves vLLM's extension (vLLM,
        miStudio's ``/v1``); raises :class:`ChatError` as :meth:`complete` does."""
        response = self._answer(self._body(messages, 1, 0.0, {"prompt_logprobs": count}), stop)
        try:
            data = response.json()
            ids, entries = [int(token) for token in data["prompt_token_ids"]], list(data["prompt_logprobs"])
        except (ValueError, KeyError, TypeError):
            self.usage.add(requests=1, failures=1)
            raise ChatError(
                "ENDPOINT_ERROR", "The endpoint's answer has no prompt_logprobs (vLLM's extension)."
            ) from None
        self._spent(data)
        return ids, entries

    def _body(
        self,
        messages: list[dict[str, str]],
        max_tokens: int,
        temperature: float,
        extra: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """A chat completion request's body (``extra``: more fields, such as an endpoint's extensions)."""
        return {
            "model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            **(extra or {}),
        }  # fmt: skip

    def _answer(self, body: dict[str, Any], stop: threading.Event | None) -> httpx.Response:
        """The endpoint's 200 response to ``body``, retried as :meth:`complete` describes."""
        attempt, waited_busy = 0, 0.0
        while True:
            wait, busy = self.backoff * 2**attempt, False
            try:
                response = self._http.post(self.url, json=body)
            except httpx.TransportError as error:
                failure = ChatError(
                    "ENDPOINT_UNREACHABLE", f"The endpoint did not answer ({type(error).__name__})."
                )
            else:
                if response.status_code == 200:
                    return response
                said = self._without_key(error_message(response))
                failure = ChatError(
                    "ENDPOINT_ERROR",
                    f"The endpoint answered {response.status_code}: {said}",
                    {"status": response.status_code},
                )
                if response.status_code not in RETRIED_STATUSES:
                    self.usage.add(requests=1, failures=1)
                    raise failure
                delay = retry_after(response)
                busy = delay is not None and response.status_code in BUSY_STATUSES
                wait = max(wait if not busy else self.backoff, delay or 0.0)
            self.usage.add(requests=1)
            if busy:
                if waited_busy + wait > self.busy_wait:
                    self.usage.add(failures=1)
                    raise ChatError(
                        "ENDPOINT_BUSY",
                        f"The endpoint was still busy after {waited_busy:.0f} s of waiting: "
                        + failure.message,
                        failure.details,
                    )
                waited_busy += wait
            elif attempt >= self.retries:
                self.usage.add(failures=1)
                raise failure
            else:
                attempt += 1
            self.usage.add(retries=1)
            pause(wait, stop)

    def _reply(self, response: httpx.Response) -> ChatReply:
        try:
            data = response.json()
            text = data["choices"][0]["message"].get("content") or ""
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            self.usage.add(requests=1, failures=1)
            raise ChatError("ENDPOINT_ERROR", "The endpoint's answer is not a chat completion.") from None
        prompt_tokens, completion_tokens = self._spent(data)
        return ChatReply(text=text, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)

    def _spent(self, data: dict[str, Any]) -> tuple[int, int]:
        """Count one answered request and its tokens (an answer's ``usage``)."""
        usage = data.get("usage") or {}
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        completion_tokens = int(usage.get("completion_tokens") or 0)
        self.usage.add(requests=1, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
        return prompt_tokens, completion_tokens

    def _without_key(self, text: str) -> str:
        """An endpoint's words with this client's key taken out (some echo the key they refused)."""
        return text.replace(self._key, REDACTED) if self._key else text


def pause(seconds: float, stop: threading.Event | None) -> None:
    """Sleep ``seconds``, or raise :class:`Stopped` as soon as ``stop`` is set."""
    if stop is None:
        time.sleep(seconds)
    elif stop.wait(seconds):
        raise Stopped


def error_message(response: httpx.Response) -> str:
    """The message of an OpenAI-shaped error body, else the start of the body (one line)."""
    try:
        body: Any = response.json()
        message = body["error"]["message"] if isinstance(body.get("error"), dict) else body.get("error")
    except (ValueError, AttributeError, KeyError, TypeError):
        message = response.text
    return " ".join(str(message or response.reason_phrase).split())[:300]


def retry_after(response: httpx.Response) -> float | None:
    """The answer's ``Retry-After`` in seconds (at most ``MAX_RETRY_AFTER_SECONDS``); None when it
    has none (or a date, which is read as none)."""
    try:
        return min(MAX_RETRY_AFTER_SECONDS, max(0.0, float(response.headers["retry-after"])))
    except (KeyError, ValueError):
        return None
