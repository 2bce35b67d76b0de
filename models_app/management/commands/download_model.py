"""``manage.py download_model MODEL``: fetch a hub model's files into MODEL_CACHE_DIR, with a progress bar."""

from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from engine.errors import EngineError
from models_app import services
from models_app.management.commandline import find_model


class Command(BaseCommand):
    help = "Download a registered hub model's files (resumable; Ctrl-C stops, the next run resumes)."

    def add_arguments(self, parser):
        parser.add_argument("model", help="model id or name")

    def handle(self, *args, **options):
        model = find_model(options["model"])
        if model.source != model.Source.HUGGINGFACE:
            raise CommandError("This model is a local folder: there is nothing to download.")
        with tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc=model.name, file=self.stdout) as bar:

            def progress(done: int, total: int) -> None:
                bar.total = total
                bar.n = done
                bar.refresh()

            try:
                services.model_download(model=model, on_progress=progress)
            except EngineError as error:
                raise CommandError(f"{error.code}: {error.message}") from None
        self.stderr.write(f"{model.name} is in the model cache.")
