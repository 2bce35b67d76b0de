"""``manage.py generate MODEL PROMPT``: one generation, its text streamed to stdout as it comes.

The text goes to stdout alone (so ``generate … > out.txt`` holds exactly the model's output),
the summary and any progress bar to stderr. Sampling defaults are ``/api/generate``'s.
Ctrl-C stops the generation in the worker and exits with status 130.
"""

import json
import sys
from argparse import BooleanOptionalAction

from django.core.management.base import BaseCommand, CommandError

from generation.cli import (
    InvalidSetting,
    checked_hooks,
    checked_sampling,
    checked_steering,
    failure_text,
    hook_list,
    load_and_wait,
    not_loaded_message,
    palette_for,
    steering_list,
    stream_generation,
    summary_line,
    terminal_safe,
)
from generation.models import Generation
from generation.services import CAPTURE_DTYPES, generation_check, result_body, sweep_header, sweep_request
from generation.streams import follow_to_end
from mistudio.errors import ApplicationError
from models_app.management.commandline import find_model, plain

INTERRUPTED_STATUS = 130  # what a shell reports for a process ended by SIGINT
SWEEP_WAIT_SECONDS = 600


class Command(BaseCommand):
    help = "Generate text with a loaded model, streaming it as it comes (Ctrl-C stops)."

    def add_arguments(self, parser):
        parser.add_argument("model", help="model id or name")
        parser.add_argument("prompt", help="the prompt; '-' reads it from stdin")
        parser.add_argument("--max-tokens", type=int, help="at most this many new tokens (default 128)")
        randomness = parser.add_mutually_exclusive_group()
        randomness.add_argument("--temperature", type=float, help="0 is greedy (default 0.7)")
        randomness.add_argument("--greedy", action="store_true", help="the same as --temperature 0")
        parser.add_argument("--top-p", type=float, help="nucleus sampling (default 0.95)")
        parser.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (0: off)")
        parser.add_argument("--repetition-penalty", type=float)
        parser.add_argument("--seed", type=int, help="make sampling reproducible")
        parser.add_argument("--stop", action="append", help="stop at this text (repeatable)")
        parser.add_argument(
            "--ignore-eos", action="store_true", help="go on past the end-of-sequence token (long probes)"
        )
        parser.add_argument("--system", default="", help="a system prompt")
        parser.add_argument(
            "--chat-template",
            action=BooleanOptionalAction,
            default=None,
            help="format the prompt with the tokenizer's chat template (default: when it has one)",
        )
        parser.add_argument(
            "--capture", action="append", metavar="HOOK,HOOK", help="capture these hook points' activations"
        )
        parser.add_argument("--capture-dtype", choices=CAPTURE_DTYPES, default="float32")
        parser.add_argument(
            "--steer",
            action="append",
            metavar="SPEC",
            help="intervene while generating (repeatable): SAE:FEATURE*COEFFICIENT adds the feature's "
            "direction, SAE:FEATURE=VALUE clamps it, or JSON / @file.json in /api/generate's shape",
        )
        parser.add_argument(
            "--sweep",
            metavar="C,C,...",
            help="a strength sweep of the one --steer intervention: the prompt once without it and once "
            "at each coefficient (an SAE feature's in units of its max activation), one seed, one batch; "
            "prints each output with its measured effect",
        )
        parser.add_argument(
            "--load", action="store_true", help="load the model first when it is not loaded (and wait)"
        )
        parser.add_argument(
            "--json", action="store_true", help="print the result object instead of streaming"
        )

    def handle(self, *args, **options):
        model = find_model(options["model"])
        prompt = sys.stdin.read() if options["prompt"] == "-" else options["prompt"]
        try:
            sampling = checked_sampling(
                {
                    "max_tokens": options["max_tokens"],
                    "temperature": 0.0 if options["greedy"] else options["temperature"],
                    "top_p": options["top_p"],
                    "top_k": options["top_k"],
                    "repetition_penalty": options["repetition_penalty"],
                    "seed": options["seed"],
                    "stop": options["stop"],
                    "ignore_eos": options["ignore_eos"] or None,
                }
            )
            capture = checked_hooks(model, hook_list(options["capture"])) if options["capture"] else []
            steering = checked_steering(model, steering_list(options["steer"])) if options["steer"] else []
        except InvalidSetting as error:
            raise CommandError(f"INVALID_PARAMETER: {error}") from None
        if options["sweep"] is not None:
            self.sweep(model, prompt, sampling, options)
            return
        request = {
            "model_id": model.id,
            "owner": None,
            "prompts": [prompt],
            "system_prompt": options["system"],
            "chat_template": options["chat_template"],
            "sampling": sampling,
            "capture": capture,
            "capture_dtype": options["capture_dtype"],
            "interventions": steering,
        }
        streaming = not options["json"]
        on_terminal = self.stdout.isatty()
        line_open = False  # the streamed text so far does not end with a newline

        def write_text(text: str) -> None:
            nonlocal line_open
            if streaming and text:
                self.stdout.write(terminal_safe(text) if on_terminal else text, ending="")
                self.stdout.flush()
                line_open = not text.endswith("\n")

        try:
            try:
                outcome = stream_generation(on_text=write_text, **request)
            except ApplicationError as error:
                if error.code != "MODEL_NOT_LOADED":
                    raise
                if not options["load"]:
                    model.refresh_from_db()
                    raise CommandError(
                        not_loaded_message(
                            model,
                            hint=f"load it with `manage.py load_model {options['model']}`, or add --load.",
                        )
                    ) from None
                load_and_wait(model, progress=self.stderr)
                outcome = stream_generation(on_text=write_text, **request)
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        except KeyboardInterrupt:  # a second Ctrl-C: do not wait for the worker to notice
            raise CommandError("Interrupted.", returncode=INTERRUPTED_STATUS) from None

        event = outcome.event
        if on_terminal and line_open:
            # Only on a terminal: piped output stays byte for byte the model's text.
            self.stdout.write("")
        if outcome.failed:
            raise CommandError(failure_text(event))
        if options["json"]:
            self.stdout.write(json.dumps(result_body(event), indent=2))
        palette = palette_for(self.stderr, options)
        if not options["json"]:
            self.stderr.write(palette.dim(summary_line(event)), style_func=plain)
        if outcome.interrupted:
            raise CommandError("Cancelled (Ctrl-C).", returncode=INTERRUPTED_STATUS)

    def sweep(self, model, prompt: str, sampling, options) -> None:
        """``--sweep``: queue the rows, wait for them, print one line per strength."""
        items = steering_list(options["steer"])
        if len(items) != 1:
            raise CommandError("INVALID_PARAMETER: --sweep varies exactly one --steer intervention.")
        try:
            coefficients = [float(value) for value in options["sweep"].replace(",", " ").split()]
        except ValueError:
            raise CommandError("INVALID_PARAMETER: --sweep takes numbers: 0.5,1,2,4.") from None
        try:
            rows = sweep_request(
                model_id=model.id, owner=None, intervention=items[0], coefficients=coefficients or None,
                prompts=[prompt], system_prompt=options["system"], chat_template=options["chat_template"],
                sampling=sampling, interface=Generation.Interface.CLI,
            )  # fmt: skip
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        ids = [row.id for row in rows]
        # Reading the rows' streams holds their leases: rows nobody waits for are withdrawn.
        if not follow_to_end(ids, timeout=SWEEP_WAIT_SECONDS, check=generation_check):
            raise CommandError(f"The sweep did not finish in {SWEEP_WAIT_SECONDS} s.")
        finished = Generation.objects.in_bulk(ids)
        header = sweep_header(rows)
        unit = "x max activation" if header["unit"] == "max_activation" else "raw"
        self.stderr.write(f"seed {header['seed']}, coefficients {unit}", style_func=plain)
        self.stdout.write("coefficient  raw       feature   KL(1st)  distinct-2  output")
        for row in (finished[row_id] for row_id in ids):
            effect = row.effect or {}

            def number(name: str, effect=effect) -> str:
                value = effect.get(name)
                return f"{value:8.4f}" if isinstance(value, float) else f"{'-':>8}"

            raw = row.sweep_coefficient * header["unit_scale"]
            completed = row.status == Generation.Status.COMPLETED
            text = row.output_text if completed else f"[{row.error_code}] {row.error_message}"
            measured = f"{number('activation_mean')} {number('first_token_kl')} {number('distinct_2'):>11}"
            line = f"{row.sweep_coefficient:>11g}  {raw:<8.4g} {measured}"
            self.stdout.write(f"{line}  {json.dumps(text[:70])}")
