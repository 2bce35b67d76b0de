"""``manage.py list_models``: the registered models as a table."""

from django.core.management.base import BaseCommand

from models_app.management.commandline import format_table, gigabytes
from models_app.models import LanguageModel
from models_app.selectors import ModelFilter


class Command(BaseCommand):
    help = "List registered models."

    def add_arguments(self, parser):
        parser.add_argument("--status", choices=LanguageModel.Status.values)
        parser.add_argument("--search")

    def handle(self, *args, **options):
        filters = {key: options[key] for key in ("status", "search") if options[key]}
        models = ModelFilter(filters, queryset=LanguageModel.objects.all()).qs
        rows = [
            [
                model.id, model.name, model.model_type, f"{(model.parameter_count or 0) / 1e6:.1f}M",
                str(model.num_layers or "—"), model.quantization,
                model.status + (" (pinned)" if model.pinned else ""),
                gigabytes(model.memory_usage_bytes), model.host_worker or "—",
            ]
            for model in models
        ]  # fmt: skip
        if not rows:
            self.stdout.write("No models. Register one with `manage.py add_model --hub-id … | --path …`.")
            return
        headers = ["id", "name", "family", "params", "layers", "quant", "status", "memory", "worker"]
        self.stdout.write(format_table(headers, rows))
