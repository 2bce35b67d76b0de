"""``manage.py train_sae_group MODEL DATASET --hooks H1,H2 --variant k=32 --variant k=64``: train a
group of SAEs and transcoders straight from the model, with a progress bar and a comparison table."""

import argparse

from django.core.management.base import BaseCommand, CommandError
from rest_framework.exceptions import ValidationError

from activations.models import Dataset
from mistudio.errors import ApplicationError
from models_app.management.commandline import find_model, follow_job
from saes import groups
from saes.groups import GroupSettings
from saes.models import ARCHITECTURES, SaeGroup
from saes.serializers import group_request_members, parse_transcoders, parse_variants


class Command(BaseCommand):
    help = "Train SAEs and transcoders from a model over a dataset, many at once (a worker runs it)."

    def add_arguments(self, parser):
        parser.add_argument("model", help="model id or name")
        parser.add_argument("dataset", help="dataset id or name")
        parser.add_argument("--hooks", default="", help="comma-separated hook points, an SAE each")
        parser.add_argument(
            "--transcoder", action="append", default=[], help="'IN -> OUT [skip]' (repeat for several)"
        )
        parser.add_argument(
            "--variant", action="append", default=[], help="'k=32 expansion_factor=8' (repeat for several)"
        )
        parser.add_argument("--architecture", choices=ARCHITECTURES, default="topk")
        parser.add_argument("--expansion", type=int, default=None, help="default 16")
        parser.add_argument("--k", type=int, default=None, help="default d_in / 12, 16 to 128")
        parser.add_argument("--lr", type=float, default=3e-4)
        parser.add_argument("--batch-size", type=int, default=4096)
        parser.add_argument("--tokens", type=int, default=None, help="default 4,000 a feature")
        parser.add_argument("--max-length", type=int, default=None, help="tokens a sample (default 128)")
        parser.add_argument("--name", default="")
        parser.add_argument(
            "--analyze",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="analyse each member over the dataset through the model at the end (default: small groups)",
        )
        parser.add_argument("--no-wait", action="store_true")
        parser.add_argument("--timeout", type=float, default=14 * 24 * 3600)

    def handle(self, *args, **options):
        model = find_model(options["model"])
        dataset = (
            Dataset.objects.filter(pk=options["dataset"]).first()
            or Dataset.objects.filter(name=options["dataset"]).first()
        )
        if dataset is None:
            raise CommandError(f"No dataset with id or name {options['dataset']!r}.")
        settings = GroupSettings(
            architecture=options["architecture"], expansion_factor=options["expansion"], k=options["k"],
            lr=options["lr"], batch_size=options["batch_size"], total_tokens=options["tokens"],
            max_length=options["max_length"],
        )  # fmt: skip
        try:
            members = group_request_members(
                hooks=[hook.strip() for hook in options["hooks"].split(",") if hook.strip()],
                transcoders=parse_transcoders("\n".join(options["transcoder"])),
                variants=parse_variants("\n".join(options["variant"])),
            )
            group = groups.sae_group_train_request(
                owner=None, model=model, dataset=dataset, settings=settings, members=members,
                name=options["name"], analyze_members=options["analyze"],
            )  # fmt: skip
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        except ValidationError as error:  # a malformed --transcoder or --variant
            raise CommandError(str(error.detail)) from None
        if options["no_wait"]:
            self.stdout.write(f"SAE group {group.id} queued ({group.members.count()} members)")
            return
        self.follow(group, timeout=options["timeout"])

    def follow(self, group: SaeGroup, *, timeout: float) -> None:
        follow_job(
            group, stdout=self.stdout, timeout=timeout, total=group.total_tokens, what="training",
            done=lambda row: row.tokens_seen, postfix=lambda row: f"{row.tokens_per_second or 0:.0f} tok/s",
            unit="tok", unit_scale=True,
        )  # fmt: skip
        self.stdout.write(f"{'SAE':<22} {'hook':<44} {'arch':<10} {'k':>4} {'L0':>7} {'EV':>7} {'CE rec':>7}")
        for sae in group.members.order_by("group_index"):
            evaluation = sae.evaluation
            hook = f"{sae.hook_name}->{sae.hook_name_out}" if sae.hook_name_out else sae.hook_name
            self.stdout.write(
                f"{sae.id:<22} {hook[:44]:<44} {sae.architecture[:10]:<10} {sae.k or '':>4} "
                f"{fmt(evaluation.get('l0'), 1)} {fmt(evaluation.get('explained_variance'))} "
                f"{fmt(evaluation.get('ce_loss_recovered'))}"
            )


def fmt(value, digits: int = 3) -> str:
    return f"{'—':>7}" if value is None else f"{value:>7.{digits}f}"
