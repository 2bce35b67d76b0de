"""What ``manage.py generate`` and ``manage.py play`` share.

Both are thin front doors to the one generation path: sampling options are checked by the
serializer ``/api/generate`` uses (same defaults, same limits, same messages), the request goes
through :func:`generation_request`, and the tokens come back through :func:`iter_events`.
This module adds what a terminal needs on top: loading a model on request, Ctrl-C that stops a
generation cleanly, colours, and the one-line summaries.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.core.management.base import CommandError

from activations.services import hook_names_for
from engine.interventions import summary as intervention_summary
from generation.interventions import interventions_request
from generation.models import Generation
from generation.serializers import SamplingSerializer
from generation.services import generation_check, generation_request, generation_stop, hook_widths
from generation.streams import iter_events
from mistudio.access import OPERATOR
from mistudio.errors import ApplicationError
from models_app import services
from models_app.management.commandline import ExactWriter, wait_for_load
from models_app.models import LanguageModel

LOAD_TIMEOUT_SECONDS = 3600.0
# How often a silent stream is asked whether the worker still lives (generation_check).
WORKER_CHECK_SECONDS = 5.0
# A silent stream returns to the reading loop this often, so a Ctrl-C is acted on promptly.
QUIET_POLL_SECONDS = 0.5


class InvalidSetting(ValueError):
    """A sampling value the API would refuse; the message is one line, ready to print."""


def checked_sampling(options: dict[str, Any]):
    """A :class:`SamplingRequest` from API-named options (absent or None: the API's default).

    Validated by ``/api/generate``'s own serializer, so a value the API refuses is refused here
    with the same message, and the defaults (temperature 0.7, top_p 0.95) cannot drift apart.
    Raises :class:`InvalidSetting`.
    """

    serializer = SamplingSerializer(
        data={name: value for name, value in options.items() if value is not None}
    )
    if not serializer.is_valid():
        raise InvalidSetting(first_error(serializer.errors))
    return serializer.sampling(serializer.validated_data)


def first_error(errors: dict[str, Any]) -> str:
    """``field: message`` for the first error DRF reported (a terminal wants one line)."""
    for name, messages in errors.items():
        message = messages[0] if isinstance(messages, list) and messages else messages
        if isinstance(message, dict):
            return first_error(message)
        return f"{name}: {message}" if name != "non_field_errors" else str(message)
    return "Invalid value."


def checked_hooks(model: LanguageModel, names: list[str]) -> list[str]:
    """Hook point names validated against the model's structure; raises :class:`InvalidSetting`."""

    try:
        return hook_names_for(model, hooks=names, layers=None)
    except ApplicationError as error:
        raise InvalidSetting(error.message) from None


def hook_list(values: list[str] | str | None) -> list[str]:
    """``"a,b"`` or ``["a,b", "c"]`` (a repeated option) as ``["a", "b", "c"]``."""
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


STEER_SHORTHAND = re.compile(r"(?P<sae>[\w-]+):(?P<feature>\d+)(?:(?P<op>[*=])(?P<number>[-+0-9.eE]+))?")


def steering_list(values: list[str] | str | None) -> list[dict[str, Any]]:
    """``--steer`` / ``/steer`` arguments as intervention objects (docs/api.md, "Interventions"):
    JSON (one object or a list), ``@file.json``, or the shorthands ``SAE:FEATURE*COEFFICIENT``
    (add the feature's decoder direction, times 1 without ``*``) and ``SAE:FEATURE=VALUE`` (clamp
    the feature). Raises :class:`InvalidSetting`."""
    if values is None:
        return []
    items: list[dict[str, Any]] = []
    for value in [values] if isinstance(values, str) else values:
        text = value.strip()
        if text.startswith("@"):
            try:
                text = Path(text[1:]).read_text()
            except OSError as error:
                raise InvalidSetting(f"steer: cannot read {text[1:]}: {error.strerror}.") from None
        if text.startswith(("{", "[")):
            try:
                parsed = json.loads(text)
            except ValueError as error:
                raise InvalidSetting(f"steer: not valid JSON ({error}).") from None
            items.extend(parsed if isinstance(parsed, list) else [parsed])
            continue
        match = STEER_SHORTHAND.fullmatch(text)
        if match is None:
            raise InvalidSetting(
                "steer: give JSON, @file.json, SAE:FEATURE*COEFFICIENT (add) or SAE:FEATURE=VALUE (clamp)."
            )
        try:
            number = float(match["number"]) if match["number"] is not None else 1.0
        except ValueError:
            raise InvalidSetting(f"steer: {match['number']!r} is not a number.") from None
        item: dict[str, Any] = {"sae": match["sae"], "feature": int(match["feature"])}
        if match["op"] == "=":
            items.append({"type": "clamp_feature", **item, "value": number})
        else:
            items.append({"type": "add", **item, "coefficient": number})
    return items


def checked_steering(model: LanguageModel, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Interventions validated for ``model`` as ``/api/generate`` does; :class:`InvalidSetting`."""
    try:
        return interventions_request(items, widths=hook_widths(model, items), user=OPERATOR)
    except ApplicationError as error:
        raise InvalidSetting(f"{error.code}: {error.message}") from None


def steering_text(item: dict[str, Any]) -> str:
    """One line for an intervention: ``add sae_…#812 x 8 at blocks.2.hook_resid_post (all)``, the
    unit named when it is the feature's max activation."""
    detail = intervention_summary(item)
    if item.get("unit") == "max_activation":
        detail += f" x max activation {item['unit_scale']:.3g}"
    positions = item["positions"] if isinstance(item["positions"], str) else f"positions {item['positions']}"
    return f"{detail} at {item['hook']} ({positions})"


# --- loading ------------------------------------------------------------------------------------


def not_loaded_message(model: LanguageModel, *, hint: str) -> str:
    state = "still loading" if model.status == LanguageModel.Status.LOADING else model.status
    return f"MODEL_NOT_LOADED: {model.name} is {state}; {hint}"


def load_and_wait(model: LanguageModel, *, progress, timeout: float = LOAD_TIMEOUT_SECONDS) -> LanguageModel:
    """Queue a load (unless one is under way), draw its progress, return the model once ready.

    Raises CommandError when the load cannot be queued or ends any other way than ``ready``.
    """

    model.refresh_from_db()
    if model.status != LanguageModel.Status.LOADING:
        try:
            model = services.model_load_request(model_id=model.id, actor=OPERATOR)
        except ApplicationError as error:
            if error.code != "ALREADY_LOADED":
                raise CommandError(f"{error.code}: {error.message}") from None
            model.refresh_from_db()
            return model
    model = wait_for_load(model, timeout=timeout, stdout=ExactWriter(progress))
    if model.status != LanguageModel.Status.READY:
        raise CommandError(f"{model.error_code or model.status}: {model.error_message or 'the load failed.'}")
    return model


# --- streaming ----------------------------------------------------------------------------------


class CtrlC:
    """Whether Ctrl-C was pressed while a generation streams.

    The first Ctrl-C only sets :attr:`pressed`; the reading loop then stops the generation and
    reads on until its final event, so the row ends ``cancelled`` and the terminal gets a clean
    summary. A KeyboardInterrupt raised in the middle of a database write or a blocking Redis
    read would leave neither. A second Ctrl-C raises KeyboardInterrupt as usual (the caller gives
    up waiting for the worker to notice).
    """

    def __init__(self):
        self.pressed = False

    def handle(self, signum, frame) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    @contextmanager
    def watching(self) -> Iterator[CtrlC]:
        # Signal handlers can only be set from the main thread; elsewhere Ctrl-C is not ours anyway.
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGINT, self.handle)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


@dataclass
class Outcome:
    """How a streamed generation ended: its final event, and whether the user stopped it."""

    generation_id: str
    event: dict[str, Any]
    interrupted: bool

    @property
    def failed(self) -> bool:
        return self.event["type"] == "failed"


def stream_generation(*, on_text: Callable[[str], None], **request: Any) -> Outcome:
    """Queue one generation (``generation_request`` keyword arguments) and stream its text.

    ``on_text`` gets each token's text as it arrives, until Ctrl-C. Returns the final event.
    Raises ApplicationError when the request is refused (``MODEL_NOT_LOADED``, bad prompt…),
    KeyboardInterrupt on a second Ctrl-C.
    """

    with CtrlC().watching() as ctrl_c:
        generation_id = generation_request(interface=Generation.Interface.CLI, **request)[0].id
        stopped = False
        last_check = time.monotonic()

        def stop_if_asked() -> None:
            nonlocal stopped
            if ctrl_c.pressed and not stopped:
                stopped = True
                generation_stop(generation_id)

        def check() -> dict[str, Any] | None:
            # Called after each quiet half second: the only chance to act on a Ctrl-C pressed
            # while the generation waits in the queue or the worker is silent.
            nonlocal last_check
            stop_if_asked()
            if time.monotonic() - last_check < WORKER_CHECK_SECONDS:
                return None
            last_check = time.monotonic()
            return generation_check(generation_id)

        for event in iter_events(generation_id, check=check, check_every=QUIET_POLL_SECONDS):
            stop_if_asked()
            if event["type"] == "token" and not ctrl_c.pressed:
                on_text(event["text"])
            elif event["type"] in ("done", "failed"):
                return Outcome(generation_id, event, interrupted=ctrl_c.pressed)
    raise CommandError("The generation's stream ended without a result.")  # iter_events never does


def tokens_per_second(event: dict[str, Any]) -> float | None:
    """The decode rate the worker measured; for a one-token reply, tokens over the whole run."""
    rate = event["timings"].get("decode_tokens_per_second")
    if rate is not None:
        return rate
    total_ms = event["timings"].get("total_ms")
    tokens = event["usage"]["completion_tokens"]
    return tokens / (total_ms / 1000) if total_ms and tokens else None


def rate_text(event: dict[str, Any]) -> str:
    rate = tokens_per_second(event)
    return f"{rate:.1f} tokens/s" if rate is not None else "— tokens/s"


def summary_line(event: dict[str, Any]) -> str:
    """``— 42 tokens · 35.2 tokens/s · prefill 12 ms · finish: length`` for a ``done`` event."""
    parts = [f"{event['usage']['completion_tokens']} tokens", rate_text(event)]
    prefill = event["timings"].get("prefill_ms")
    if prefill is not None:
        parts.append(f"prefill {prefill:.0f} ms")
    parts.append(f"finish: {event['finish_reason'] or event['status']}")
    line = "— " + " · ".join(parts)
    if event.get("activations"):
        line += f"\n  activations: {activations_text(event['activations'])}"
    return line


def activations_text(activations: dict[str, Any]) -> str:
    """``act_… (blocks.0.hook_resid_post [17, 64])``: where the captured activations went."""
    shapes = activations.get("shapes") or {}
    hooks = ", ".join(
        f"{name} {list(shapes[name])}" if name in shapes else name for name in activations["hooks"]
    )
    return f"{activations.get('cache_id') or 'not stored'} ({hooks})"


def failure_text(event: dict[str, Any]) -> str:
    return f"{event.get('code') or 'GENERATION_FAILED'}: {event.get('message') or 'The generation failed.'}"


# --- terminal -----------------------------------------------------------------------------------

# A model can emit any byte: on a terminal, control characters would move the cursor, ring the
# bell or start escape sequences. Shown as their Unicode symbols instead (tab and newline stay).
TERMINAL_SAFE = {
    **{code: 0x2400 + code for code in range(32) if code not in (9, 10)},
    127: 0x2421,
    **{code: 0xFFFD for code in range(0x80, 0xA0)},
}


def terminal_safe(text: str) -> str:
    return text.translate(TERMINAL_SAFE)


class Palette:
    """ANSI colours, or nothing at all when the output is not a terminal (a pipe, a file)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def paint(self, code: str, text: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.enabled and text else text

    def dim(self, text: str) -> str:
        return self.paint("2", text)

    def bold(self, text: str) -> str:
        return self.paint("1", text)

    def red(self, text: str) -> str:
        return self.paint("31", text)

    def cyan(self, text: str) -> str:
        return self.paint("36", text)


def palette_for(stream, options: dict[str, Any]) -> Palette:
    """Colours on a terminal, following Django's ``--no-color``/``--force-color`` and NO_COLOR."""
    if options.get("force_color"):
        return Palette(True)
    if options.get("no_color") or os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return Palette(False)
    return Palette(bool(getattr(stream, "isatty", lambda: False)()))
