"""``manage.py list_saes``: the sparse autoencoders as a table."""

from django.core.management.base import BaseCommand

from mistudio.jobs import JobStatus
from models_app.management.commandline import format_table
from saes.models import SparseAutoencoder


def number(value, digits: int) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


class Command(BaseCommand):
    help = "List sparse autoencoders with their held-out metrics."

    def add_arguments(self, parser):
        parser.add_argument("--model", help="model id")

    def handle(self, *args, **options):
        saes = SparseAutoencoder.objects.select_related("model")
        if options["model"]:
            saes = saes.filter(model_id=options["model"])
        rows = [row(sae) for sae in saes]
        if not rows:
            self.stdout.write("No SAEs yet (`manage.py train_sae CACHE` or `manage.py import_sae FOLDER`).")
            return
        headers = ["id", "model", "hook", "arch", "size", "status", "EV", "L0", "dead", "CE rec."]
        self.stdout.write(format_table(headers, rows))


def row(sae: SparseAutoencoder) -> list[str]:
    evaluation = sae.evaluation
    return [
        sae.id,
        sae.model.name if sae.model else sae.model_name or "—",
        sae.hook_name,
        sae.architecture,
        f"{sae.d_in}→{sae.d_sae}",
        f"running {sae.progress:.0f}%" if sae.status == JobStatus.RUNNING else sae.status,
        number(evaluation.get("explained_variance"), 3),
        number(evaluation.get("l0"), 1),
        str(evaluation.get("dead_features", "—")),
        number(evaluation.get("ce_loss_recovered"), 3),
    ]
