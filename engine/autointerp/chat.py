"""An OpenAI-compatible chat client for explainers and scorers.

One ``POST {base_url}/chat/completions`` per call, from any number of threads (one pooled
``httpx.Client``). Transient failures (no connection, a timeout, 429, 5xx) are retried with
exponential backoff, honouring ``Retry-After``; anything else is a :class:`ChatError` at once. The
key is sent in the ``Authorization`` header and nowhere else: never logged, never in an error.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from engine.errors import EngineError

RETRIED_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
MAX_RETRY_AFTER_SECONDS = 30.0


class ChatError(EngineError):
    """A request that failed for good: ``ENDPOINT_UNREACHABLE`` (after its retries),
    ``ENDPOINT_ERROR`` (a status it was not worth retrying, or still failing after its retries)."""


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
    ) -> None:
        self.model = model
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.retries, self.backoff = retries, backoff
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
    ) -> ChatReply:
        """The reply's text and token counts (``extra``: more fields of the request body, such as an
        endpoint's extensions); raises :class:`ChatError`."""
        body = {
            "model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            **(extra or {}),
        }  # fmt: skip
        attempt = 0
        while True:
            wait = self.backoff * 2**attempt
            try:
                response = self._http.post(self.url, json=body)
            except httpx.TransportError as error:
                failure = ChatError(
                    "ENDPOINT_UNREACHABLE", f"The endpoint did not answer ({type(error).__name__})."
                )
            else:
                if response.status_code == 200:
                    return self._reply(response)
                failure = ChatError(
                    "ENDPOINT_ERROR",
                    f"The endpoint answered {response.status_code}: {error_message(response)}",
                    {"status": response.status_code},
                )
                if response.status_code not in RETRIED_STATUSES:
                    self.usage.add(requests=1, failures=1)
                    raise failure
                wait = max(wait, retry_after(response))
            self.usage.add(requests=1)
            if attempt >= self.retries:
                self.usage.add(failures=1)
                raise failure
            attempt += 1
            self.usage.add(retries=1)
            time.sleep(wait)

    def _reply(self, response: httpx.Response) -> ChatReply:
        try:
            data = response.json()
            text = data["choices"][0]["message"].get("content") or ""
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            self.usage.add(requests=1, failures=1)
            raise ChatError("ENDPOINT_ERROR", "The endpoint's answer is not a chat completion.") from None
        usage = data.get("usage") or {}
        reply = ChatReply(
            text=text,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
        )
        self.usage.add(
            requests=1, prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens
        )
        return reply


def error_message(response: httpx.Response) -> str:
    """The message of an OpenAI-shaped error body, else the start of the body (one line)."""
    try:
        body: Any = response.json()
        message = body["error"]["message"] if isinstance(body.get("error"), dict) else body.get("error")
    except (ValueError, AttributeError, KeyError, TypeError):
        message = response.text
    return " ".join(str(message or response.reason_phrase).split())[:300]


def retry_after(response: httpx.Response) -> float:
    try:
        return min(MAX_RETRY_AFTER_SECONDS, max(0.0, float(response.headers.get("retry-after", 0))))
    except ValueError:
        return 0.0
