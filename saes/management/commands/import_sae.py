"""``manage.py import_sae /abs/folder [--model M] [--hook H]``: a SAELens folder, a Gemma Scope params.npz,
or (``--format circuit_tracer --model M``) a circuit-tracer transcoder set, one row per layer.

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
        parser.add_argument(
            "--format",
            choices=["auto", "saelens", "gemma_scope", "circuit_tracer"],
            default="auto",
            help="circuit_tracer: a transcoder set, layer_{i}.safetensors, one row per layer (needs --model)",
        )
        parser.add_argument("--model", help="the registered model it belongs to (id or name)")
        parser.add_argument("--hook", help="miStudio hook name (when the folder names none)")
        parser.add_argument("--name", default="")
        parser.add_argument("--no-wait", action="store_true", help="queue the import and return")
        parser.add_argument("--timeout", type=float, default=3600)

    def handle(self, *args, **options):
        model = find_model(options["model"]) if options["model"] else None
        try:
            if options["format"] == "circuit_tracer":
                if model is None:
                    raise CommandError(
                        "A circuit-tracer transcoder set needs --model (one transcoder per layer)."
                    )
                saes, created = services.transcoder_set_import(
                    owner=None, local_path=options["path"], model=model, name=options["name"]
                )
            else:
                sae, created = services.sae_import(
                    owner=None, local_path=options["path"], format=options["format"], model=model,
                    hook=options["hook"], name=options["name"],
                )  # fmt: skip
                saes = [sae]
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        if not created:
            self.stdout.write("already imported: " + ", ".join(f"{sae.id} ({sae.status})" for sae in saes))
            return
        if options["no_wait"]:
            self.stdout.write("import of " + ", ".join(sae.id for sae in saes) + " queued")
            return
        deadline = time.monotonic() + options["timeout"]
        for sae in saes:
            while sae.status in SparseAutoencoder.ACTIVE:
                if time.monotonic() > deadline:
                    raise CommandError(
                        f"Timed out waiting; {sae.id} is still {sae.status} (a worker imports it)."
                    )
                time.sleep(0.2)
                sae.refresh_from_db()
            if sae.status != SparseAutoencoder.Status.COMPLETED:
                raise CommandError(f"{sae.error_code}: {sae.error_message}")
            writes = f" → {sae.hook_name_out}" if sae.hook_name_out else ""
            shape = f"{sae.architecture} {sae.d_in}→{sae.d_sae}"
            self.stdout.write(f"imported {sae.id}: {shape} at {sae.hook_name}{writes} ({sae.source})")
