"""``manage.py list_caches``: the activation caches as a table."""

from django.core.management.base import BaseCommand

from activations.models import ActivationCache
from models_app.management.commandline import format_table, gigabytes


class Command(BaseCommand):
    help = "List activation caches."

    def add_arguments(self, parser):
        parser.add_argument("--model", help="model id")

    def handle(self, *args, **options):
        caches = ActivationCache.objects.select_related("model", "dataset")
        if options["model"]:
            caches = caches.filter(model_id=options["model"])
        rows = [
            [
                cache.id,
                cache.model.name,
                cache.dataset.name if cache.dataset else "—",
                cache.status,
                ", ".join(cache.hooks)[:60],
                f"{cache.num_tokens:,}",
                cache.dtype,
                gigabytes(cache.file_size_bytes),
                cache.last_accessed_at.strftime("%Y-%m-%d %H:%M"),
            ]
            for cache in caches
        ]
        if not rows:
            self.stdout.write("No activation caches yet (`manage.py extract_activations`).")
            return
        headers = ["id", "model", "dataset", "status", "hooks", "tokens", "dtype", "size", "last used"]
        self.stdout.write(format_table(headers, rows))
