"""``manage.py import_sae /abs/folder [--model M] [--hook H]``: a SAELens folder or Gemma Scope params.npz.

The folder's headers are checked here; a worker reads the arrays (this waits for it by default).
"""

import time

from django.core.management.base import BaseCommand, CommandError

from mistudio.errors import ApplicationError
from models_app.management.commandline import find_model
from saes import services
from saes.models import SparseAutoencoder


class Command(BaseCommand):
    help = "Import an SAE from a folder under LOCAL_MODEL_ROOTS (SAELens layout, or Gemma Scope params.npz)."

    def add_arguments(self, parser):
        parser.add_argument("path", help="absolute path of the folder")
        parser.add_argument("--format", choices=["auto", "saelens", "gemma_scope"], default="auto")
        parser.add_argument("--model", help="the registered model it belongs to (id or name)")
        parser.add_argument("--hook", help="miStudio hook name (when the folder names none)")
        parser.add_argument("--name", default="")
        parser.add_argument("--no-wait", action="store_true", help="queue the import and return")
        parser.add_argument("--timeout", type=float, default=3600)

    def handle(self, *args, **options):
        model = find_model(options["model"]) if options["model"] else None
        try:
            sae, created = services.sae_import(
                owner=None, local_path=options["path"], format=options["format"], model=model,
                hook=options["hook"], name=options["name"],
            )  # fmt: skip
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        if not created:
            self.stdout.write(f"already imported: {sae.id} ({sae.status})")
            return
        if options["no_wait"]:
            self.stdout.write(f"import of {sae.id} queued")
            return
        deadline = time.monotonic() + options["timeout"]
        while sae.status in SparseAutoencoder.ACTIVE:
            if time.monotonic() > deadline:
                raise CommandError(
                    f"Timed out waiting; {sae.id} is still {sae.status} (a worker imports it)."
                )
            time.sleep(0.2)
            sae.refresh_from_db()
        if sae.status != SparseAutoencoder.Status.COMPLETED:
            raise CommandError(f"{sae.error_code}: {sae.error_message}")
        self.stdout.write(
            f"imported {sae.id}: {sae.architecture} {sae.d_in}→{sae.d_sae} at {sae.hook_name} ({sae.source})"
        )
