"""Generation through ``POST /api/generate``: the request body (capture and interventions in the
``mistudio`` extension), a :class:`Generation` with captured activations as numpy arrays, and a
:class:`GenerationStream` of tokens as they come (the API's server-sent events)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from mistudio_client.errors import error_from_response
from mistudio_client.resources import _id

if TYPE_CHECKING:
    from mistudio_client.client import Client


def _generation_body(
    model: Any,
    prompt: str,
    *,
    capture: Sequence[str] = (),
    interventions: Sequence[Any] = (),
    max_tokens: int = 32,
    temperature: float = 0.0,
    **parameters: Any,
) -> dict[str, Any]:
    """``POST /api/generate``'s body: capture (returned, not stored) and interventions go in the
    ``mistudio`` extension."""
    body: dict[str, Any] = {
        "model_id": _id(model),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        **parameters,
    }
    extension: dict[str, Any] = {}
    if capture:
        extension.update(capture=list(capture), store=False)
    if interventions:
        extension["interventions"] = [
            item.to_dict() if hasattr(item, "to_dict") else item for item in interventions
        ]
    if extension:
        body["mistudio"] = extension
    return body


class GenerationStream:
    """A streamed generation (:meth:`Client.stream`): its tokens as they come, then ``result``."""

    def __init__(self, client: Client, body: dict[str, Any]) -> None:
        self.client, self.body = client, body
        self.request_id: str | None = None
        self.result: Generation | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        with self.client._http.stream("POST", "/api/generate", json=self.body) as response:
            if response.status_code >= 400:
                response.read()
                self.client.raise_for(response)
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[len("data: ") :])
                kind = event.pop("type", None)
                if kind == "started":
                    self.request_id = event.get("request_id")
                elif kind == "token":
                    yield event
                elif kind == "done":
                    self.result = Generation.from_answer(event)
                    return
                elif kind == "error":
                    raise error_from_response(500, event, response.headers)


@dataclass
class Generation:
    """A generation's text, its prompt's and completion's token ids, and the captured activations
    (hook → [prompt + completion tokens, width])."""

    text: str
    input_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str | None
    activations: dict[str, np.ndarray] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_answer(cls, answer: dict[str, Any]) -> Generation:
        captured = (answer.get("activations") or {}).get("values") or {}
        return cls(
            text=answer["output_text"],
            input_token_ids=answer.get("input_token_ids", []),
            output_token_ids=answer.get("output_token_ids", []),
            finish_reason=answer.get("finish_reason"),
            activations={hook: np.asarray(values, dtype=np.float32) for hook, values in captured.items()},
            raw=answer,
        )
