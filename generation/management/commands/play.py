"""``manage.py play [MODEL]``: chat with a loaded model in the terminal, one reply streamed at a time.

In the spirit of ``ollama run``: pick a model (or name it), load it if need be, then type. The
conversation is kept as chat ``messages`` and sent whole with every turn (the model's chat
template formats it, or a plain ``User:``/``Assistant:`` layout when it has none); slash
commands change the sampling, the system prompt and activation capture between turns.

Ctrl-C while a reply streams stops that reply in the worker; a stopped reply, like a failed
one, is left out of the conversation together with the message that asked for it (the message
is still in the line history: arrow-up brings it back). Ctrl-C at the prompt clears the line,
Ctrl-D or ``/quit`` leaves.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from generation.cli import (
    InvalidSetting,
    Outcome,
    Palette,
    activations_text,
    checked_hooks,
    checked_sampling,
    checked_steering,
    failure_text,
    hook_list,
    load_and_wait,
    not_loaded_message,
    palette_for,
    rate_text,
    steering_list,
    steering_text,
    stream_generation,
    terminal_safe,
)
from generation.models import storable_text
from mistudio.errors import ApplicationError
from models_app.management.commandline import find_model
from models_app.models import LanguageModel

INTERRUPTED_STATUS = 130
PROMPT = ">>> "
HELP = """\
/temp X                 temperature, 0 to 2 (0: greedy)
/top_p X                nucleus sampling, above 0 up to 1
/top_k N                sample among the N likeliest tokens (0: off)
/max N | off            at most N new tokens per reply (off: 128, shrunk to fit the context)
/seed N | off           reproducible sampling
/ignore_eos on | off    go on past the end-of-sequence token
/system [TEXT]          set the system prompt (alone: clear it)
/capture HOOK[,HOOK] | off
                        capture these hook points' activations for each reply
/steer SPEC             intervene in every reply: SAE:FEATURE*COEFFICIENT adds the
                        feature's direction, SAE:FEATURE=VALUE clamps it, or JSON
                        (alone: list the interventions)
/unsteer [N]            drop intervention N (alone: all of them)
/reset                  forget the conversation
/show                   the current settings
/help                   this list
/quit                   leave (Ctrl-D too)
Ctrl-C stops a reply; a stopped reply is left out of the conversation."""


@dataclass
class ChatSettings:
    """What the slash commands change; sampling names and defaults as in ``/api/generate``."""

    temperature: float
    top_p: float
    top_k: int = 0
    max_tokens: int | None = None  # None: the API's default, which shrinks to fit the context
    seed: int | None = None
    ignore_eos: bool = False
    system: str = ""
    capture: list[str] = field(default_factory=list)
    interventions: list[dict[str, Any]] = field(default_factory=list)

    def sampling_options(self, **changes: Any) -> dict[str, Any]:
        options = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
        }
        return {**options, **changes}


def default_settings() -> ChatSettings:
    sampling = checked_sampling({})
    return ChatSettings(temperature=sampling.temperature, top_p=sampling.top_p)


class Command(BaseCommand):
    help = "Chat with a model in the terminal (/help inside lists the commands)."

    def add_arguments(self, parser):
        parser.add_argument("model", nargs="?", help="model id or name (default: choose from a list)")

    def handle(self, *args, **options):
        self.palette: Palette = palette_for(self.stdout, options)
        if sys.stdin.isatty():
            # Importing readline is what gives input() line editing and history.
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401
        try:
            model = find_model(options["model"]) if options["model"] else self.choose_model()
            model = self.ready_model(model)
        except (KeyboardInterrupt, EOFError):
            self.stdout.write("")
            raise CommandError("No model to chat with.", returncode=INTERRUPTED_STATUS) from None
        Chat(self, model).run()

    # --- before the chat --------------------------------------------------------------------------

    def ask(self, question: str) -> str:
        self.stdout.flush()
        return input(question).strip()

    def choose_model(self) -> LanguageModel:
        """List the models (ready ones first, numbered) and ask which."""
        models = list(LanguageModel.objects.order_by("name"))
        if not models:
            raise CommandError(
                "No models registered; add one with `manage.py add_model --path … | --hub-id …`."
            )
        ready = [model for model in models if model.status == LanguageModel.Status.READY]
        others = [model for model in models if model.status != LanguageModel.Status.READY]
        choices = ready + others
        if ready:
            self.stdout.write(self.palette.bold("Ready:"))
            for number, model in enumerate(ready, start=1):
                self.stdout.write(f"  {number}) {model.name}  {self.palette.dim(model_facts(model))}")
        if others:
            self.stdout.write(self.palette.bold("Not loaded:"))
            for number, model in enumerate(others, start=len(ready) + 1):
                state = model.status + (f" ({model.error_code})" if model.error_code else "")
                self.stdout.write(
                    f"  {number}) {model.name}  {self.palette.dim(f'{model.model_type} · {state}')}"
                )
        while True:
            answer = self.ask(f"Model [1-{len(choices)}{', Enter: 1' if ready else ''}]: ")
            if not answer and ready:
                return ready[0]
            if answer.isdigit() and 1 <= int(answer) <= len(choices):
                return choices[int(answer) - 1]
            if answer:
                try:
                    return find_model(answer)
                except CommandError as error:
                    self.stdout.write(str(error))

    def ready_model(self, model: LanguageModel) -> LanguageModel:
        """The model once ready: loads it (after asking) when it is not."""
        model.refresh_from_db()
        if model.status == LanguageModel.Status.READY and model.host_worker:
            return model
        if model.status != LanguageModel.Status.LOADING:
            answer = self.ask(f"{model.name} is {model.status}. Load it now? [Y/n] ")
            if answer.lower() not in ("", "y", "yes"):
                raise CommandError(
                    not_loaded_message(model, hint=f"load it with `manage.py load_model {model.id}`.")
                )
        else:
            self.stdout.write(f"{model.name} is loading; waiting for it.")
        return load_and_wait(model, progress=self.stdout)


def model_facts(model: LanguageModel) -> str:
    parameters = f"{model.parameter_count / 1e6:.1f}M parameters" if model.parameter_count else ""
    quantization = f"quantization {model.quantization}"
    where = f"on {model.host_worker}" if model.host_worker else ""
    return " · ".join(part for part in (model.model_type, parameters, quantization, where) if part)


class Chat:
    """The read-reply loop of one session: its conversation, settings and slash commands."""

    def __init__(self, command: Command, model: LanguageModel):
        self.command, self.model = command, model
        self.out, self.palette = command.stdout, command.palette
        self.settings = default_settings()
        self.history: list[dict[str, str]] = []
        self.commands: dict[str, Callable[[str], None]] = {
            "/temp": self.set_temperature,
            "/temperature": self.set_temperature,
            "/top_p": self.set_top_p,
            "/top_k": self.set_top_k,
            "/max": self.set_max_tokens,
            "/seed": self.set_seed,
            "/ignore_eos": self.set_ignore_eos,
            "/system": self.set_system,
            "/capture": self.set_capture,
            "/steer": self.steer,
            "/unsteer": self.unsteer,
            "/reset": self.reset,
            "/clear": self.reset,
            "/show": self.show,
            "/help": self.help,
            "/?": self.help,
        }

    def say(self, text: str = "") -> None:
        self.out.write(text)

    def note(self, text: str) -> None:
        self.out.write(self.palette.dim(text))

    def error(self, text: str) -> None:
        self.out.write(self.palette.red(text))

    def run(self) -> None:
        self.say(f"{self.palette.bold(self.model.name)}  {self.palette.dim(model_facts(self.model))}")
        self.note("Type a message to chat; /help lists the commands, /quit or Ctrl-D leaves.")
        while True:
            try:
                line = self.command.ask(PROMPT)
            except KeyboardInterrupt:  # like the Python REPL: drop the line, prompt again
                self.say("")
                continue
            except EOFError:
                self.say("")
                return
            try:
                if not line:
                    continue
                if line.split()[0] in ("/quit", "/exit", "/bye"):
                    return
                if line.startswith("/"):
                    self.run_command(line)
                else:
                    self.reply(line)
            except KeyboardInterrupt:  # between streams (a command, a load): back to the prompt
                self.say("")

    # --- slash commands ---------------------------------------------------------------------------

    def run_command(self, line: str) -> None:
        name, _, argument = line.partition(" ")
        handler = self.commands.get(name.lower())
        if handler is None:
            self.error(f"Unknown command {name}; /help lists them.")
            return
        try:
            handler(argument.strip())
        except InvalidSetting as error:
            self.error(str(error))

    def set_sampling(self, name: str, value: Any) -> None:
        """Check the new value with the API's serializer before it replaces the old one."""
        sampling = checked_sampling(self.settings.sampling_options(**{name: value}))
        setattr(self.settings, name, None if value is None else getattr(sampling, name))
        self.note(f"{name} = {'off' if value is None else getattr(self.settings, name)}")

    def show_or_set(self, name: str, argument: str, *, off: bool = False) -> None:
        if not argument:
            current = getattr(self.settings, name)
            self.note(f"{name} = {'off' if current is None else current}")
        elif off and argument.lower() == "off":
            self.set_sampling(name, None)
        else:
            self.set_sampling(name, argument)

    def set_temperature(self, argument: str) -> None:
        self.show_or_set("temperature", argument)

    def set_top_p(self, argument: str) -> None:
        self.show_or_set("top_p", argument)

    def set_top_k(self, argument: str) -> None:
        self.show_or_set("top_k", argument)

    def set_max_tokens(self, argument: str) -> None:
        self.show_or_set("max_tokens", argument, off=True)

    def set_seed(self, argument: str) -> None:
        self.show_or_set("seed", argument, off=True)

    def set_ignore_eos(self, argument: str) -> None:
        if argument.lower() not in ("", "on", "off"):
            raise InvalidSetting("ignore_eos: on or off.")
        if argument:
            self.settings.ignore_eos = argument.lower() == "on"
        self.note(f"ignore_eos = {'on' if self.settings.ignore_eos else 'off'}")

    def set_system(self, argument: str) -> None:
        self.settings.system = argument
        self.note(f"system prompt: {argument}" if argument else "system prompt cleared")

    def set_capture(self, argument: str) -> None:
        if not argument:
            self.note(f"capture = {', '.join(self.settings.capture) or 'off'}")
            return
        if argument.lower() == "off":
            self.settings.capture = []
            self.note("capture off")
            return
        self.settings.capture = checked_hooks(self.model, hook_list(argument))
        self.note(f"capturing {', '.join(self.settings.capture)} for each reply")

    def steer(self, argument: str) -> None:
        if argument:
            added = checked_steering(self.model, self.settings.interventions + steering_list(argument))
            self.settings.interventions = added
        if not self.settings.interventions:
            self.note("no interventions")
        for number, item in enumerate(self.settings.interventions, start=1):
            self.note(f"{number}) {steering_text(item)}")

    def unsteer(self, argument: str) -> None:
        items = self.settings.interventions
        if not argument:
            items.clear()
            self.note("interventions off")
            return
        if not argument.isdigit() or not 1 <= int(argument) <= len(items):
            raise InvalidSetting(f"unsteer: give a number from 1 to {len(items)} (/steer lists them).")
        removed = items.pop(int(argument) - 1)
        self.note(f"dropped: {steering_text(removed)}")

    def reset(self, argument: str) -> None:
        self.history.clear()
        self.note("conversation cleared")

    def show(self, argument: str) -> None:
        settings = self.settings
        rows = [
            ("model", f"{self.model.name} ({self.model.id})"),
            ("temperature", settings.temperature),
            ("top_p", settings.top_p),
            ("top_k", f"{settings.top_k}{' (off)' if not settings.top_k else ''}"),
            ("max_tokens", settings.max_tokens or "default (128, shrunk to fit the context)"),
            ("seed", "off" if settings.seed is None else settings.seed),
            ("ignore_eos", "on" if settings.ignore_eos else "off"),
            ("system", settings.system or "(none)"),
            ("capture", ", ".join(settings.capture) or "off"),
            ("steering", "; ".join(steering_text(item) for item in settings.interventions) or "off"),
            ("history", f"{len(self.history)} messages"),
        ]
        for name, value in rows:
            self.say(f"  {name:<12} {value}")

    def help(self, argument: str) -> None:
        self.say(HELP)

    # --- replies ----------------------------------------------------------------------------------

    def reply(self, text: str) -> None:
        """Send the conversation plus ``text``, stream the reply, keep it if it completed."""
        self.history.append({"role": "user", "content": text})
        writer = ReplyWriter(self.out)
        try:
            outcome = self.generate(writer)
        except KeyboardInterrupt:  # a second Ctrl-C: stop waiting for the worker to notice the first
            self.history.pop()
            writer.end_line()
            self.note("(stopped; this exchange is left out of the conversation)")
            return
        writer.end_line()
        if outcome is None:
            self.history.pop()
            return
        event = outcome.event
        if outcome.failed:
            self.history.pop()
            self.error(failure_text(event))
            if event.get("code") == "CONTEXT_LENGTH_EXCEEDED":
                self.note("/reset clears the conversation; /max sets a smaller reply length.")
            return
        tokens = event["usage"]["completion_tokens"]
        if outcome.interrupted:
            self.history.pop()
            self.note(f"(stopped after {tokens} tokens; this exchange is left out of the conversation)")
            return
        # Sent back as a prompt next turn, where NUL is refused: keep the text as the row does.
        self.history.append({"role": "assistant", "content": storable_text(event["output_text"]).strip()})
        self.note(f"({tokens} tokens, {rate_text(event)})")
        if not event["output_text"].strip() and event.get("finish_reason") == "stop":
            self.note(
                "(an empty reply: the model ended it at once. A base model without a chat template "
                "often does; /ignore_eos on makes it go on, /reset starts again)"
            )
        if event.get("activations"):
            self.note(f"activations: {activations_text(event['activations'])}")

    def generate(self, writer: ReplyWriter) -> Outcome | None:
        """Stream one reply; None when it could not be asked for (the reason is printed)."""
        request = {
            "model_id": self.model.id,
            "owner": None,
            "messages": list(self.history),
            "system_prompt": self.settings.system,
            "chat_template": None,
            "capture": self.settings.capture,
            "interventions": self.settings.interventions,
        }
        try:
            request["sampling"] = checked_sampling(self.settings.sampling_options())
            try:
                return stream_generation(on_text=writer.write, **request)
            except ApplicationError as error:
                if error.code != "MODEL_NOT_LOADED":
                    raise
                # The worker stopped or evicted the model since the last turn: offer to load it again.
                self.model = self.command.ready_model(self.model)
                return stream_generation(on_text=writer.write, **request)
        except (ApplicationError, CommandError, InvalidSetting) as error:
            writer.end_line()
            message = f"{error.code}: {error.message}" if isinstance(error, ApplicationError) else str(error)
            self.error(message)
            return None


class ReplyWriter:
    """Writes a reply's text as it streams, without its leading blank space, flushed at once."""

    def __init__(self, out):
        self.out = out
        self.started = False
        self.at_line_start = True

    def write(self, text: str) -> None:
        if not self.started:
            # A reply after "Assistant:" starts with a space or a newline; it reads better without.
            text = text.lstrip()
            self.started = bool(text)
        if text:
            self.out.write(terminal_safe(text), ending="")
            self.out.flush()
            self.at_line_start = text.endswith("\n")

    def end_line(self) -> None:
        if not self.at_line_start:
            self.out.write("")
            self.at_line_start = True
