"""``manage.py load_model MODEL``: queue a load and follow it with a progress bar."""

from django.core.management.base import BaseCommand, CommandError

from mistudio.access import OPERATOR
from mistudio.errors import ApplicationError
from models_app import services
from models_app.management.commandline import find_model, gigabytes, wait_for_load
from models_app.models import LanguageModel


class Command(BaseCommand):
    help = "Load a model in a worker (a worker must be running: `manage.py worker`)."

    def add_arguments(self, parser):
        parser.add_argument("model", help="model id or name")
        parser.add_argument("--quantization", choices=LanguageModel.Quantization.values)
        parser.add_argument("--no-wait", action="store_true", help="queue the load and return")
        parser.add_argument("--timeout", type=float, default=3600)

    def handle(self, *args, **options):
        model = find_model(options["model"])
        try:
            model = services.model_load_request(
                model_id=model.id, actor=OPERATOR, quantization=options["quantization"]
            )
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        if options["no_wait"]:
            self.stdout.write(f"load of {model.name} queued (job {model.rq_job_id})")
            return
        model = wait_for_load(model, timeout=options["timeout"], stdout=self.stdout)
        if model.status != LanguageModel.Status.READY:
            raise CommandError(f"{model.error_code or model.status}: {model.error_message}")
        self.stdout.write(
            f"{model.name} ready on {model.host_worker} in {model.load_time_seconds:.1f} s, "
            f"{gigabytes(model.memory_usage_bytes)}"
        )
