"""``manage.py analyze_sae SAE [--cache CACHE | --dataset DATASET [--samples N] [--max-length T]]``:
run a feature analysis with a progress bar, over a cache or over a dataset read through the model."""

from django.core.management.base import BaseCommand, CommandError

from activations.models import ActivationCache, Dataset
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
        "Analyse every feature of an SAE over an activation cache, or over a dataset read straight through "
        "its model (no cache written); a worker runs it; this waits by default."
    )

    def add_arguments(self, parser):
        parser.add_argument("sae", help="SAE id (sae_…)")
        parser.add_argument("--cache", help="activation cache id (default: the one the SAE was trained on)")
        parser.add_argument(
            "--dataset", help="dataset id, read through the SAE's model (without a cache: its training set)"
        )
        parser.add_argument("--samples", type=int, help="with --dataset: how many of its samples")
        parser.add_argument("--max-length", type=int, help="with --dataset: tokens a sample")
        parser.add_argument("--no-wait", action="store_true")
        parser.add_argument("--timeout", type=float, default=2 * 24 * 3600)

    def handle(self, *args, **options):
        sae = find_sae(options["sae"])
        cache = None
        if options["cache"]:
            cache = ActivationCache.objects.filter(pk=options["cache"]).first()
            if cache is None:
                raise CommandError(f"No activation cache {options['cache']!r} (see `manage.py list_caches`).")
        dataset = None
        if options["dataset"]:
            dataset = Dataset.objects.filter(pk=options["dataset"]).first()
            if dataset is None:
                raise CommandError(
                    f"No dataset {options['dataset']!r} (see the Datasets page or GET /api/datasets)."
                )
        try:
            analysis = services.analysis_request(
                owner=None, sae=sae, cache=cache, dataset=dataset, sample_count=options["samples"],
                max_length=options["max_length"],
            )  # fmt: skip
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
        source = "tokens read through the model" if analysis.source == "model" else "tokens"
        self.stdout.write(
            f"Analysis {analysis.id} completed: {summary.get('features')} features over "
            f"{summary.get('tokens', analysis.tokens):,} {source} in {summary.get('seconds', 0):.1f}s, "
            f"{summary.get('dead')} dead."
            f" See `manage.py show_feature {analysis.sae_id} INDEX`."
        )
        if summary.get("logit_note"):
            self.stdout.write(summary["logit_note"])
