"""``manage.py unload_model MODEL``: free a loaded model's memory in its worker."""

from django.core.management.base import BaseCommand, CommandError

from mistudio.errors import ApplicationError
from models_app import services
from models_app.management.commandline import find_model


class Command(BaseCommand):
    help = "Unload a model from its worker."

    def add_arguments(self, parser):
        parser.add_argument("model", help="model id or name")

    def handle(self, *args, **options):
        model = find_model(options["model"])
        try:
            services.model_unload_request(model_id=model.id)
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        self.stdout.write(f"unload of {model.name} queued on {model.host_worker}")
