"""``manage.py export_sae SAE OUT``: the SAE in SAELens' layout, as a folder or (``OUT.tar``) an archive."""

import shutil
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from mistudio.access import OPERATOR
from mistudio.errors import ApplicationError
from saes.models import SparseAutoencoder
from saes.selectors import sae_export_files, sae_export_stream


class Command(BaseCommand):
    help = (
        "Write a completed SAE as a SAELens folder (cfg.json, sae_weights.safetensors, and labels.json "
        "with its feature labels) or a .tar of one."
    )

    def add_arguments(self, parser):
        parser.add_argument("sae", help="SAE id (sae_…)")
        parser.add_argument("output", help="a folder to create, or a file ending in .tar")

    def handle(self, *args, **options):
        sae = SparseAutoencoder.objects.filter(pk=options["sae"]).first()
        if sae is None or sae.status != SparseAutoencoder.Status.COMPLETED:
            raise CommandError(f"No completed SAE {options['sae']!r} (see `manage.py list_saes`).")
        output = Path(options["output"])
        try:
            files = sae_export_files(sae, user=OPERATOR)
            chunks = sae_export_stream(sae, user=OPERATOR, files=files)
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        if output.suffix == ".tar":
            with open(output, "wb") as handle:
                for chunk in chunks:
                    handle.write(chunk)
        else:
            if output.exists() and any(output.iterdir()):
                raise CommandError(f"{output} exists and is not empty.")
            output.mkdir(parents=True, exist_ok=True)
            for name, path, data in files:
                if data is None:
                    shutil.copyfile(path, output / name)
                else:
                    (output / name).write_bytes(data)
        self.stdout.write(f"wrote {output} (SAELens layout: sae_lens.SAE.load_from_disk reads it)")
