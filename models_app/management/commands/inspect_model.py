"""``manage.py inspect_model``: what a model is and what it would need, without loading weights."""

import json

from django.core.management.base import BaseCommand, CommandError

from engine.inspection import memory_estimates
from mistudio.errors import ApplicationError
from models_app import services
from models_app.management.commandline import find_model, format_table, gigabytes


class Command(BaseCommand):
    help = "Show a model's architecture, size and memory estimate per quantization (no weights loaded)."

    def add_arguments(self, parser):
        target = parser.add_mutually_exclusive_group(required=True)
        target.add_argument("model", nargs="?", help="a registered model's id or name")
        target.add_argument("--hub-id")
        target.add_argument("--path")
        parser.add_argument("--revision", default="")
        parser.add_argument("--json", action="store_true", help="machine-readable output")

    def handle(self, *args, **options):

        if options["model"]:
            model = find_model(options["model"])
            source, identifier, revision = model.source, model.identifier, model.commit_sha or model.revision
        else:
            source = "huggingface" if options["hub_id"] else "local"
            identifier, revision = options["hub_id"] or options["path"], options["revision"]
        try:
            info, identifier, _ = services.model_inspect_source(
                source=source, identifier=identifier, revision=revision
            )
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        estimates = memory_estimates(info)
        summary = {
            "identifier": identifier, "model_type": info.model_type, "family": info.family,
            "architecture": info.architecture, "parameter_count": info.parameter_count,
            "hidden_size": info.hidden_size, "num_layers": info.num_layers, "vocab_size": info.vocab_size,
            "context_length": info.context_length, "memory_estimates": estimates,
        }  # fmt: skip
        if options["json"]:
            self.stdout.write(json.dumps(summary, indent=2))
            return
        for key, value in summary.items():
            if key != "memory_estimates":
                self.stdout.write(
                    f"{key:>16}: {value:,}" if isinstance(value, int) else f"{key:>16}: {value}"
                )
        self.stdout.write("")
        self.stdout.write(
            format_table(["quantization", "estimate"], [[k, gigabytes(v)] for k, v in estimates.items()])
        )
