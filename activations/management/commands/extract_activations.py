"""``manage.py extract_activations MODEL DATASET --layers 0 6 11``: extract with a live progress bar."""

import time

from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from activations import services
from activations.models import Dataset, ExtractionJob
from mistudio.errors import ApplicationError
from models_app.management.commandline import find_model


class Command(BaseCommand):
    help = "Extract activations of a model over a dataset into the activation cache (waits by default)."

    def add_arguments(self, parser):
        parser.add_argument("model", help="model id or name")
        parser.add_argument("dataset", help="dataset id or name")
        parser.add_argument(
            "--hooks", nargs="*", default=None, help="hook names, e.g. blocks.3.mlp.hook_post"
        )
        parser.add_argument("--layers", nargs="*", type=int, default=None, help="shorthand for resid_post")
        parser.add_argument("--samples", type=int, default=None, help="the first N samples (default: all)")
        parser.add_argument("--batch-size", type=int, default=16)
        parser.add_argument("--max-length", type=int, help="default: 512, or the model's context if shorter")
        parser.add_argument(
            "--dtype", choices=services.STORAGE_DTYPES, help="default: the model's compute dtype"
        )
        parser.add_argument("--no-wait", action="store_true")
        parser.add_argument("--timeout", type=float, default=24 * 3600)

    def handle(self, *args, **options):
        model = find_model(options["model"])
        dataset = (
            Dataset.objects.filter(pk=options["dataset"]).first()
            or Dataset.objects.filter(name=options["dataset"]).first()
        )
        if dataset is None:
            raise CommandError(f"No dataset with id or name {options['dataset']!r}.")
        try:
            job = services.extraction_request(
                model_id=model.id,
                dataset_id=dataset.id,
                owner=None,
                hooks=options["hooks"],
                layers=options["layers"],
                sample_count=options["samples"],
                batch_size=options["batch_size"],
                max_length=options["max_length"],
                dtype=options["dtype"],
            )
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        if job.cached:
            self.stdout.write(f"Using cached activations: {job.cache_id}")
            return
        if options["no_wait"]:
            self.stdout.write(f"extraction {job.id} queued")
            return
        deadline = time.monotonic() + options["timeout"]
        with tqdm(total=job.total_samples, unit="sample", desc=job.id, file=self.stdout) as bar:
            while job.status in ExtractionJob.ACTIVE:
                if time.monotonic() > deadline:
                    raise CommandError("Timed out waiting; the extraction goes on in the worker.")
                time.sleep(0.3)
                job.refresh_from_db()
                bar.total = job.total_samples or bar.total
                bar.n = job.samples_processed
                eta = f"{job.eta_seconds:.0f}s" if job.eta_seconds is not None else "?"
                bar.set_postfix_str(f"{job.tokens_per_second or 0:.0f} tok/s, ETA {eta}")
        if job.status != ExtractionJob.Status.COMPLETED:
            raise CommandError(f"{job.status}: {job.error_code} {job.error_message}".strip())
        self.stdout.write(f"cache {job.cache_id} ({job.extraction_time_seconds:.1f} s)")
