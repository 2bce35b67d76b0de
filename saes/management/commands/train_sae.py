"""``manage.py train_sae CACHE --hook H --architecture topk --k 32``: train with a progress bar."""

from django.core.management.base import BaseCommand, CommandError

from activations.models import ActivationCache
from mistudio.errors import ApplicationError
from models_app.management.commandline import follow_job
from saes import services
from saes.models import ARCHITECTURES, SparseAutoencoder


class Command(BaseCommand):
    help = "Train a sparse autoencoder on an activation cache (a worker runs it; this waits by default)."

    def add_arguments(self, parser):
        parser.add_argument("cache", help="activation cache id (act_…)")
        parser.add_argument("--hook", help="hook point in the cache (default: its only one)")
        parser.add_argument("--architecture", choices=ARCHITECTURES, default="topk")
        parser.add_argument(
            "--expansion", type=int, default=None, help="d_sae = expansion x d_in (default 8)"
        )
        parser.add_argument("--d-sae", type=int, default=None)
        parser.add_argument(
            "--k", type=int, default=None, help="topk / batchtopk (default: d_in / 24, 4 to 128)"
        )
        parser.add_argument("--l1", type=float, default=None, help="standard: L1 coefficient (default 5)")
        parser.add_argument("--l0", type=float, default=None, help="jumprelu: L0 coefficient (default 1)")
        parser.add_argument("--lr", type=float, default=3e-4)
        parser.add_argument("--batch-size", type=int, default=4096)
        parser.add_argument(
            "--tokens", type=int, default=None, help="default: one pass over the cache, at least 512 steps"
        )
        parser.add_argument("--b-dec-init", choices=services.B_DEC_INITS, default="geometric_median")
        parser.add_argument(
            "--dead-after-steps", type=int, default=None, help="default: a tenth of the steps, at most 1000"
        )
        parser.add_argument("--name", default="")
        parser.add_argument("--no-wait", action="store_true")
        parser.add_argument("--timeout", type=float, default=7 * 24 * 3600)

    def handle(self, *args, **options):
        cache = ActivationCache.objects.filter(pk=options["cache"]).first()
        if cache is None:
            raise CommandError(f"No activation cache {options['cache']!r} (see `manage.py list_caches`).")
        hook = options["hook"] or (cache.hooks[0] if len(cache.hooks) == 1 else None)
        if hook is None:
            raise CommandError(
                f"The cache has several hooks; choose one with --hook: {', '.join(cache.hooks)}"
            )
        try:
            sae = services.sae_train_request(
                owner=None, cache=cache, hook=hook, architecture=options["architecture"],
                expansion_factor=options["expansion"], d_sae=options["d_sae"], k=options["k"],
                l1_coefficient=options["l1"], l0_coefficient=options["l0"], lr=options["lr"],
                batch_size=options["batch_size"], total_tokens=options["tokens"],
                b_dec_init=options["b_dec_init"], dead_after_steps=options["dead_after_steps"],
                name=options["name"],
            )  # fmt: skip
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        if options["no_wait"]:
            self.stdout.write(f"SAE {sae.id} queued")
            return
        self.follow(sae, timeout=options["timeout"])

    def follow(self, sae: SparseAutoencoder, *, timeout: float) -> None:
        def postfix(row: SparseAutoencoder) -> str:
            metrics = row.metrics or {}
            eta = f"{row.eta_seconds:.0f}s" if row.eta_seconds is not None else "?"
            return (
                f"L0 {metrics.get('l0', 0):.1f}, EV {metrics.get('explained_variance', 0):.3f}, "
                f"dead {metrics.get('dead', 0)}, {row.tokens_per_second or 0:.0f} tok/s, ETA {eta}"
            )

        follow_job(
            sae, stdout=self.stdout, timeout=timeout, total=sae.total_tokens, what="training",
            done=lambda row: row.tokens_seen, postfix=postfix, unit="tok", unit_scale=True,
        )  # fmt: skip
        evaluation = sae.evaluation
        self.stdout.write(
            f"SAE {sae.id}: held-out explained variance {fmt(evaluation.get('explained_variance'))}, "
            f"L0 {fmt(evaluation.get('l0'))}, dead {evaluation.get('dead_features')}, "
            f"CE loss recovered {fmt(evaluation.get('ce_loss_recovered'))} "
            f"({sae.training_time_seconds or 0:.1f} s)"
        )


def fmt(value) -> str:
    return "pending" if value is None else f"{value:.4f}"
