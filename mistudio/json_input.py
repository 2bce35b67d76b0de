"""JSON request bodies: one parser for every view, so hostile JSON is a 400 everywhere.

Python's ``json`` recurses once per nesting level: a body of a few thousand ``[`` raises
``RecursionError`` (not ``ValueError``), which views would turn into a 500; it also accepts
``NaN`` and ``Infinity``, which are not JSON. Every JSON body — DRF views (``JSONParser``), the
async generation views (``mistudio.async_api.json_body``) and WebSocket messages — is read by
:func:`parse_json`, which refuses both, and refuses nesting deeper than ``MAX_JSON_DEPTH`` so that
no later step (validation, storage, rendering) ever walks a pathological structure.
"""

from __future__ import annotations

import codecs
import json
from typing import Any

from django.conf import settings
from rest_framework import parsers
from rest_framework.exceptions import ParseError

# Deeper than any request miStudio accepts (chat messages are three levels deep).
MAX_JSON_DEPTH = 32


class MalformedJSON(ValueError):
    """The text is not a JSON document miStudio accepts; the message says why, for the client."""


def _refuse_constant(name: str) -> None:
    raise MalformedJSON(f"{name} is not a JSON value")


def json_depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (a scalar is 0), without recursion."""
    deepest, pending = 0, [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            pending.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            pending.extend((child, depth + 1) for child in item)
        else:
            continue
        deepest = max(deepest, depth + 1)
    return deepest


def parse_json(raw: bytes | str) -> Any:
    """The JSON document in ``raw`` (UTF-8); :class:`MalformedJSON` for anything else."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise MalformedJSON(f"it nests deeper than {MAX_JSON_DEPTH} levels") from None
    except UnicodeDecodeError as error:
        raise MalformedJSON(f"it is not UTF-8 (byte {error.start})") from None
    except ValueError as error:
        raise MalformedJSON(str(error)) from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise MalformedJSON(f"it nests deeper than {MAX_JSON_DEPTH} levels")
    return value


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser on :func:`parse_json` (``DEFAULT_PARSER_CLASSES``)."""

    def parse(self, stream, media_type=None, parser_context=None):
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            raw = stream.read() if stream is not None else b""
            text = codecs.decode(raw, encoding) if raw else ""
        except UnicodeDecodeError as error:
            raise ParseError(
                f"The body is not valid JSON: it is not {encoding} (byte {error.start})."
            ) from None
        try:
            return parse_json(text)
        except MalformedJSON as error:
            raise ParseError(f"The body is not valid JSON: {error}.") from None
