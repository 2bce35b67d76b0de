"""``manage.py add_model``: register a hub or local model (inspected, not loaded), or Gemma 3 270M
from its packages (``--gemma3-270m``, as ``manage.py install_gemma3``)."""

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from mistudio.errors import ApplicationError
from models_app import services
from models_app.management.commandline import find_owner
from models_app.models import LanguageModel


class Command(BaseCommand):
    help = "Register a model from the Hugging Face hub (--hub-id) or a local folder (--path)."

    def add_arguments(self, parser):
        source = parser.add_mutually_exclusive_group(required=True)
        source.add_argument("--hub-id", help="e.g. openai-community/gpt2")
        source.add_argument("--path", help="an absolute folder, or .gguf file, inside LOCAL_MODEL_ROOTS")
        source.add_argument(
            "--gemma3-270m", action="store_true", help="Gemma 3 270M (Q4_K_M GGUF) from its packages"
        )
        parser.add_argument("--name", default="")
        parser.add_argument("--revision", default="", help="hub branch, tag or commit")
        parser.add_argument("--quantization", choices=LanguageModel.Quantization.values, default="none")
        parser.add_argument("--auto-load", action="store_true", help="queue a load right away")
        parser.add_argument("--pin", action="store_true", help="never evict it to make room")
        parser.add_argument(
            "--keep-alive", type=int, default=None, help="unload after this many idle seconds"
        )
        parser.add_argument("--owner", help="username of the owner")

    def handle(self, *args, **options):
        if options["gemma3_270m"]:
            call_command("install_gemma3", stdout=self.stdout, stderr=self.stderr)
            return
        owner = find_owner(options["owner"])
        source = LanguageModel.Source.HUGGINGFACE if options["hub_id"] else LanguageModel.Source.LOCAL
        try:
            model = services.model_register(
                source=source,
                identifier=options["hub_id"] or options["path"],
                owner=owner,
                name=options["name"],
                revision=options["revision"],
                quantization=options["quantization"],
                auto_load=options["auto_load"],
                pinned=options["pin"],
                keep_alive_seconds=options["keep_alive"],
            )
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        self.stderr.write(
            f"registered {model.name}: {model.model_type}, {model.parameter_count:,} parameters, "
            f"{model.num_layers} layers" + (" — load queued" if options["auto_load"] else "")
        )
        self.stdout.write(model.id)
