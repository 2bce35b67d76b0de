"""Responses of the OpenAI-compatible API: finish reasons, logprobs, bodies and stream chunks."""

from __future__ import annotations

from typing import Any

from generation.apis import (
    server_sent,
)
from models_app.models import LanguageModel


def finish_reason(event: dict[str, Any]) -> str:
    # "cancelled" only reaches a client whose generation an operator stopped; OpenAI has no such value.
    return "length" if event.get("finish_reason") == "length" else "stop"


def token_text(payload: dict[str, Any]) -> str:
    """A token's own text: its decoding among the alternatives, else the text it released."""
    for token_id, text, _logprob in payload.get("top_logprobs") or []:
        if token_id == payload["token_id"]:
            return text
    return payload.get("text", "")


def utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": (text := token_text(payload)),
                "logprob": payload.get("logprob"),
                "bytes": utf8(text),
                "top_logprobs": [
                    {"token": top_text, "logprob": logprob, "bytes": utf8(top_text)}
                    for _token_id, top_text, logprob in payload.get("top_logprobs") or []
                ],
            }
            for payload in payloads
        ],
        "refusal": None,
    }


def top_logprob_map(payload: dict[str, Any]) -> dict[str, float]:
    """``{token: logprob}``, most likely first; of two ids that decode alike the likelier keeps the key."""
    alternatives: dict[str, float] = {}
    for _token_id, text, logprob in payload.get("top_logprobs") or []:
        alternatives.setdefault(text, logprob)
    return alternatives


def completion_logprobs(payloads: list[dict[str, Any]], *, offset: int) -> dict[str, Any]:
    """The completions API's parallel lists; ``offset`` is where the first token's text begins."""
    offsets = []
    for payload in payloads:
        offsets.append(offset)
        offset += len(payload.get("text", ""))
    return {
        "tokens": [token_text(payload) for payload in payloads],
        "token_logprobs": [payload.get("logprob") for payload in payloads],
        # None for an echoed prompt's first token, which has no logprob.
        "top_logprobs": [top_logprob_map(payload) if "logprob" in payload else None for payload in payloads],
        "text_offset": offsets,
    }


def prompt_logprobs(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's ``prompt_logprobs`` (None for the first token; else ``{token id: {logprob, rank,
    decoded_token}}``, the prompt's own token first, then the alternatives; rank is null for a
    prompt token outside them) and ``prompt_token_ids``."""
    entries: list[dict[str, Any] | None] = []
    for payload in payloads:
        if "logprob" not in payload:
            entries.append(None)
            continue
        tops = payload.get("top_logprobs") or []
        ranks = {token_id: rank for rank, (token_id, _text, _logprob) in enumerate(tops, start=1)}
        entry = {
            str(payload["token_id"]): {
                "logprob": payload["logprob"],
                "rank": ranks.get(payload["token_id"]),
                "decoded_token": token_text(payload),
            }
        }
        for token_id, text, logprob in tops:
            entry.setdefault(
                str(token_id), {"logprob": logprob, "rank": ranks[token_id], "decoded_token": text}
            )
        entries.append(entry)
    return {"prompt_logprobs": entries, "prompt_token_ids": [payload["token_id"] for payload in payloads]}


def extensions(event: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = {"mistudio": {"request_id": event["request_id"], "timings": event.get("timings")}}
    if event.get("activations"):
        extra["activations"] = event["activations"]
    return extra


def chat_completion_body(event: dict[str, Any], *, model: LanguageModel, created: int, logprobs: bool):
    return {
        "id": f"chatcmpl-{event['request_id']}",
        "object": "chat.completion",
        "created": created,
        "model": model.id,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": event["output_text"], "refusal": None},
                "logprobs": chat_logprobs(event.get("logprobs") or []) if logprobs else None,
                "finish_reason": finish_reason(event),
            }
        ],
        "usage": event["usage"],
        **extensions(event),
        **(prompt_logprobs(event["prompt_logprobs"]) if "prompt_logprobs" in event else {}),
    }


def completion_choice(
    event: dict[str, Any], index: int, *, logprobs: bool, echo: str | None
) -> dict[str, Any]:
    """One choice of a completion; ``echo`` (the prompt) goes before its text, and its tokens (the
    first without a logprob, as OpenAI's) before the completion's in ``logprobs``."""
    payloads = event.get("logprobs") or []
    if echo is not None:
        payloads = (event.get("prompt_logprobs") or []) + payloads
    choice = {
        "text": (echo or "") + event["output_text"],
        "index": index,
        "logprobs": completion_logprobs(payloads, offset=0) if logprobs else None,
        "finish_reason": finish_reason(event),
    }
    if echo is None and "prompt_logprobs" in event:  # vLLM's extension, asked for by name
        choice.update(prompt_logprobs(event["prompt_logprobs"]))
    return choice


def completion_body(
    events: list[dict[str, Any]],
    *,
    model: LanguageModel,
    created: int,
    logprobs: bool,
    echo: list[str] | None,
):
    first = events[0]
    body = {
        "id": f"cmpl-{first['request_id']}",
        "object": "text_completion",
        "created": created,
        "model": model.id,
        "choices": [
            completion_choice(event, index, logprobs=logprobs, echo=echo[index] if echo else None)
            for index, event in enumerate(events)
        ],
        "usage": {
            key: sum(event["usage"][key] for event in events)
            for key in ("prompt_tokens", "completion_tokens", "total_tokens")
        },
        **extensions(first),
    }
    if len(events) > 1:
        body["mistudio"]["batch"] = [
            {"index": index, "request_id": event["request_id"], "timings": event.get("timings")}
            for index, event in enumerate(events)
        ]
    return body


class ChunkWriter:
    """Builds one stream's chunks in OpenAI's ``chat.completion.chunk`` / ``text_completion`` shape."""

    def __init__(self, *, chat: bool, request_id: str, model: LanguageModel, created: int, usage: bool):
        self.chat, self.usage = chat, usage
        self.header = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model.id,
        }
        self.offset = 0  # characters of completion text sent so far (completions' text_offset)

    def chunk(self, choice: dict[str, Any], **extra: Any) -> str:
        body = {**self.header, "choices": [{"index": 0, **choice}]}
        if self.usage:
            body["usage"] = None  # as OpenAI: every chunk but the last carries usage: null
        return server_sent({**body, **extra})

    def opening(self) -> list[str]:
        if not self.chat:
            return []
        return [
            self.chunk(
                {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            )
        ]

    def logprobs(self, payloads: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        if payloads is None:
            return None
        return chat_logprobs(payloads) if self.chat else completion_logprobs(payloads, offset=self.offset)

    def text(self, text: str, payloads: list[dict[str, Any]] | None, *, finish: str | None = None, **extra):
        logprobs = self.logprobs(payloads)
        self.offset += len(text)
        if self.chat:
            # A token's chunk always has content ("" when it released none); the finish chunk has none.
            delta = {"content": text} if text or finish is None else {}
            return self.chunk({"delta": delta, "logprobs": logprobs, "finish_reason": finish}, **extra)
        return self.chunk({"text": text, "logprobs": logprobs, "finish_reason": finish}, **extra)

    def closing(self, event: dict[str, Any], payloads: list[dict[str, Any]] | None) -> list[str]:
        chunks = [self.text("", payloads or None, finish=finish_reason(event), **extensions(event))]
        if self.usage:
            chunks.append(server_sent({**self.header, "choices": [], "usage": event["usage"]}))
        return chunks
