"""``manage.py analyze_sae SAE [--cache CACHE]``: run a feature analysis with a progress bar."""

from django.core.management.base import BaseCommand, CommandError

from activations.models import ActivationCache
from features import services
from features.models import FeatureAnalysis
from mistudio.errors import ApplicationError
from models_app.management.commandline import follow_job
from saes.management.commandline import find_sae

PHASES = {
    0: "queued",
    1: "pass 1/3: density, top-k",
    2: "pass 2/3: histograms, examples",
    3: "pass 3/3: contexts",
}


class Command(BaseCommand):
    help = (
        "Analyse every feature of an SAE over an activation cache (a worker runs it; this waits by default)."
    )

    def add_arguments(self, parser):
        parser.add_argument("sae", help="SAE id (sae_…)")
        parser.add_argument("--cache", help="activation cache id (default: the one the SAE was trained on)")
        parser.add_argument("--no-wait", action="store_true")
        parser.add_argument("--timeout", type=float, default=2 * 24 * 3600)

    def handle(self, *args, **options):
        sae = find_sae(options["sae"])
        cache = None
        if options["cache"]:
            cache = ActivationCache.objects.filter(pk=options["cache"]).first()
            if cache is None:
                raise CommandError(f"No activation cache {options['cache']!r} (see `manage.py list_caches`).")
        try:
            analysis = services.analysis_request(owner=None, sae=sae, cache=cache)
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        if options["no_wait"]:
            self.stdout.write(f"Analysis {analysis.id} queued")
            return
        self.follow(analysis, timeout=options["timeout"])

    def follow(self, analysis: FeatureAnalysis, *, timeout: float) -> None:
        def postfix(row: FeatureAnalysis) -> str:
            eta = f"{row.eta_seconds:.0f}s" if row.eta_seconds is not None else "?"
            return f"{PHASES.get(row.phase, 'done')}, {row.tokens_per_second or 0:,.0f} tok/s, ETA {eta}"

        follow_job(
            analysis, stdout=self.stdout, timeout=timeout, total=100.0, done=lambda row: row.progress,
            postfix=postfix, what="analysis", unit="%", bar_format="{l_bar}{bar}| {postfix}",
        )  # fmt: skip
        summary = analysis.summary
        self.stdout.write(
            f"Analysis {analysis.id} completed: {summary.get('features')} features over "
            f"{analysis.tokens:,} tokens in {summary.get('seconds', 0):.1f}s, {summary.get('dead')} dead."
            f" See `manage.py show_feature {analysis.sae_id} INDEX`."
        )
        if summary.get("logit_note"):
            self.stdout.write(summary["logit_note"])
