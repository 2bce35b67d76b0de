"""``manage.py analyze_sae SAE [--cache CACHE]``: run a feature analysis with a progress bar."""

import time

from django.core.management.base import BaseCommand, CommandError, OutputWrapper
from tqdm import tqdm

from activations.models import ActivationCache
from features import services
from features.models import FeatureAnalysis
from mistudio.errors import ApplicationError
from models_app.management.commandline import ExactWriter
from saes.models import SparseAutoencoder

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
        sae = SparseAutoencoder.objects.filter(pk=options["sae"]).first()
        if sae is None:
            raise CommandError(f"No SAE {options['sae']!r} (see `manage.py list_saes`).")
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
        deadline = time.monotonic() + timeout
        out = ExactWriter(self.stdout) if isinstance(self.stdout, OutputWrapper) else self.stdout
        with tqdm(
            total=100.0, unit="%", desc=analysis.id, file=out, bar_format="{l_bar}{bar}| {postfix}"
        ) as bar:
            while analysis.status in FeatureAnalysis.ACTIVE:
                if time.monotonic() > deadline:
                    raise CommandError("Timed out waiting; the analysis goes on in the worker.")
                time.sleep(0.5)
                analysis.refresh_from_db()
                bar.n = analysis.progress
                eta = f"{analysis.eta_seconds:.0f}s" if analysis.eta_seconds is not None else "?"
                phase, speed = PHASES.get(analysis.phase, "done"), analysis.tokens_per_second or 0
                bar.set_postfix_str(f"{phase}, {speed:,.0f} tok/s, ETA {eta}")
        if analysis.status != FeatureAnalysis.Status.COMPLETED:
            raise CommandError(f"{analysis.status}: {analysis.error_code} {analysis.error_message}".strip())
        summary = analysis.summary
        self.stdout.write(
            f"Analysis {analysis.id} completed: {summary.get('features')} features over "
            f"{analysis.tokens:,} tokens in {summary.get('seconds', 0):.1f}s, {summary.get('dead')} dead."
            f" See `manage.py show_feature {analysis.sae_id} INDEX`."
        )
        if summary.get("logit_note"):
            self.stdout.write(summary["logit_note"])
