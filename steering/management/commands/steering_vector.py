"""``manage.py steering_vector``: compute (difference of means), import, list and export vectors.

    manage.py steering_vector create MODEL HOOK --positive "…" --positive "…" --negative "…" [--last]
    manage.py steering_vector import MODEL HOOK vector.safetensors [--name NAME]
    manage.py steering_vector list [--model MODEL]
    manage.py steering_vector export sv_… out.safetensors

``create`` queues the job on the model's worker (or the shared queue) and waits for it; use the
vector with ``generate --steer '{"type": "add", "steering_vector": "sv_…", "coefficient": 4}'``.
"""

import time
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from mistudio.access import OPERATOR
from mistudio.errors import ApplicationError
from models_app.management.commandline import find_model
from steering import selectors, services
from steering.models import SteeringVector

WAIT_SECONDS = 3600


def read_prompts(values: list[str] | None) -> list[str]:
    """``--positive TEXT`` (repeatable) or ``--positive @file.txt`` (one prompt a line)."""
    prompts = []
    for value in values or []:
        if value.startswith("@"):
            try:
                text = Path(value[1:]).read_text()
            except OSError as error:
                raise CommandError(f"Cannot read {value[1:]}: {error.strerror}.") from None
            prompts.extend(line for line in text.splitlines() if line.strip())
        else:
            prompts.append(value)
    return prompts


class Command(BaseCommand):
    help = "Steering vectors: create (difference of means of two prompt lists), import, list, export."

    def add_arguments(self, parser):
        actions = parser.add_subparsers(dest="action", required=True)
        create = actions.add_parser(
            "create", help="the mean activation over --positive minus over --negative"
        )
        create.add_argument("model", help="model id or name")
        create.add_argument("hook", help="hook point, e.g. blocks.6.hook_resid_post")
        create.add_argument(
            "--positive", action="append", required=True, help="a prompt, or @file (a line each)"
        )
        create.add_argument(
            "--negative", action="append", required=True, help="a prompt, or @file (a line each)"
        )
        create.add_argument("--last", action="store_true", help="each prompt's last token, not every token")
        create.add_argument("--name", default="")
        imported = actions.add_parser("import", help="a safetensors file holding one 1-D tensor")
        imported.add_argument("model")
        imported.add_argument("hook")
        imported.add_argument("file", type=Path)
        imported.add_argument("--name", default="")
        listing = actions.add_parser("list", help="the stored vectors")
        listing.add_argument("--model", help="only this model's")
        export = actions.add_parser("export", help="write a vector's safetensors file")
        export.add_argument("vector", help="sv_…")
        export.add_argument("file", type=Path)

    def handle(self, *args, **options):
        try:
            getattr(self, f"handle_{options['action']}")(options)
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None

    def handle_create(self, options):
        vector = services.vector_request(
            owner=None, model=find_model(options["model"]), hook_name=options["hook"],
            positive=read_prompts(options["positive"]), negative=read_prompts(options["negative"]),
            reduction="last" if options["last"] else "mean", name=options["name"],
        )  # fmt: skip
        # A status on stderr that does not repeat the result's line (stdout), which starts with the id.
        self.stderr.write("Queued; waiting for a worker (`manage.py worker`)…")
        deadline = time.monotonic() + WAIT_SECONDS
        while vector.status in SteeringVector.ACTIVE and time.monotonic() < deadline:
            time.sleep(0.2)
            vector.refresh_from_db()
        if vector.status != SteeringVector.Status.COMPLETED:
            raise CommandError(
                f"{vector.error_code or vector.status}: {vector.error_message or 'not finished'}"
            )
        self.stdout.write(self.line(vector))

    def handle_import(self, options):
        try:
            data = options["file"].read_bytes()
        except OSError as error:
            raise CommandError(f"Cannot read {options['file']}: {error.strerror}.") from None
        vector = services.vector_import(
            owner=None, model=find_model(options["model"]), hook_name=options["hook"], data=data,
            name=options["name"],
        )  # fmt: skip
        self.stdout.write(self.line(vector))

    def handle_list(self, options):
        model_id = find_model(options["model"]).id if options["model"] else None
        vectors = selectors.vector_list(user=OPERATOR, model_id=model_id)
        if not vectors:
            self.stdout.write("No steering vectors.")
        for vector in vectors:
            self.stdout.write(self.line(vector))

    def handle_export(self, options):
        vector = selectors.completed_vector(user=OPERATOR, vector_id=options["vector"])
        options["file"].write_bytes(vector.path.read_bytes())
        self.stdout.write(f"{vector.id} -> {options['file']}")

    @staticmethod
    def line(vector: SteeringVector) -> str:
        norm = f"norm {vector.norm:.3f}" if vector.norm is not None else vector.status
        return f"{vector.id}  {vector.name or '-'}  {vector.hook_name} [{vector.width or '?'}]  {norm}"
