"""``manage.py add_dataset PATH``: register a text / JSONL / CSV file or a ``save_to_disk`` folder."""

from django.core.management.base import BaseCommand, CommandError

from activations import services
from engine.datasets import FORMATS as DATASET_FORMATS
from mistudio.errors import ApplicationError


class Command(BaseCommand):
    help = "Register a dataset from a file or folder inside LOCAL_DATA_ROOTS."

    def add_arguments(self, parser):
        parser.add_argument("path", help="absolute path of a file or folder inside LOCAL_DATA_ROOTS")
        parser.add_argument("--name", default="")
        parser.add_argument("--format", choices=list(DATASET_FORMATS))
        parser.add_argument("--field", help="JSONL field / CSV or dataset column (default: text)")

    def handle(self, *args, **options):
        try:
            dataset = services.dataset_create_from_local(
                name=options["name"], path=options["path"], owner=None, format=options["format"],
                field=options["field"],
            )  # fmt: skip
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        self.stderr.write(f"registered {dataset.name}: {dataset.sample_count} samples ({dataset.format})")
        self.stdout.write(dataset.id)
