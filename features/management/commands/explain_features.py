"""``manage.py explain_features SAE --model MODEL [--top N | --indices ... | --all]``: explain and
score features with a language model (a worker runs the job; this shows its estimate, then follows
it with a progress bar and prints the scores' distribution)."""

from django.core.management.base import BaseCommand, CommandError

from engine.autointerp.scoring import scorer_names
from features import explanations, selectors
from features.models import Explanation, ExplanationJob
from mistudio.access import OPERATOR
from mistudio.errors import ApplicationError
from models_app.management.commandline import find_owner, follow_job
from saes.management.commandline import find_sae


class Command(BaseCommand):
    help = "Explain an SAE's features with a language model and score the explanations (detection, fuzzing)."

    def add_arguments(self, parser):
        parser.add_argument("sae", help="SAE id (sae_…)")
        parser.add_argument(
            "--model", required=True, help="the explainer: a loaded model (local) or the endpoint's name"
        )
        parser.add_argument("--scorer", help="the scorer model (default: the explainer)")
        parser.add_argument(
            "--endpoint", default=explanations.LOCAL, help="'local' (this /v1) or a configured name"
        )
        parser.add_argument("--owner", help="the user the job runs as (needed on 'local': /v1 serves users)")
        which = parser.add_mutually_exclusive_group()
        which.add_argument("--top", type=int, default=50, help="the N densest features (default 50)")
        which.add_argument("--indices", type=int, nargs="+", help="these features")
        which.add_argument("--all", action="store_true", help="every live feature")
        parser.add_argument("--concurrency", type=int, help="requests at once (default 16)")
        parser.add_argument("--scorers", nargs="+", choices=scorer_names())
        parser.add_argument("--estimate", action="store_true", help="print the estimate only")
        parser.add_argument("--no-wait", action="store_true")
        parser.add_argument("--timeout", type=float, default=2 * 24 * 3600)

    def handle(self, *args, **options):
        sae = find_sae(options["sae"])
        owner = find_owner(options["owner"])
        if options["indices"]:
            selection = {"kind": "list", "indices": options["indices"]}
        else:
            selection = {"kind": "all"} if options["all"] else {"kind": "top", "count": options["top"]}
        settings = {name: options[name] for name in ("concurrency", "scorers") if options[name]}
        try:
            analysis = selectors.current_analysis(user=owner or OPERATOR, sae=sae)
            request = {
                "owner": owner, "analysis": analysis, "endpoint": options["endpoint"],
                "explainer_model": options["model"], "scorer_model": options["scorer"],
                "selection": selection, "options": settings,
            }  # fmt: skip
            verdict = explanations.explanation_request(**request, dry_run=True)
            if verdict["refusal"]:  # the same answer the request would get: said before anything starts
                raise CommandError(f"{verdict['refusal']['code']}: {verdict['refusal']['message']}")
            for warning in verdict["warnings"]:
                self.stdout.write(f"Warning: {warning}")
            estimate = verdict["estimate"]
            self.stdout.write(
                f"{estimate['features']} features: {estimate['requests']:,} requests, about "
                f"{estimate['prompt_tokens']:,} prompt tokens, at most "
                f"{estimate['completion_tokens_at_most']:,} completion tokens."
            )
            if options["estimate"]:
                return
            job = explanations.explanation_request(**request)
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        if options["no_wait"]:
            self.stdout.write(f"Explanation job {job.id} queued")
            return
        self.follow(job, timeout=options["timeout"])

    def follow(self, job: ExplanationJob, *, timeout: float) -> None:
        follow_job(
            job, stdout=self.stdout, timeout=timeout, total=len(job.indices), unit="feature", what="job",
            done=lambda row: row.features_done,
            postfix=lambda row: f"{row.requests_sent:,} requests, {row.features_per_minute or 0:.1f}/min",
        )  # fmt: skip
        scores = job.summary.get("scores", {})
        self.stdout.write(
            f"Explanation job {job.id} completed: {job.summary.get('explained', 0)} explained, "
            f"failures {job.summary.get('failures') or 'none'}."
        )
        for name in (*Explanation.SCORE_COLUMNS.values(), "score"):
            entry = scores.get(name) or {}
            if entry.get("count"):
                deciles = " ".join(f"{value:.2f}" for value in entry["deciles"])
                self.stdout.write(
                    f"  {name:<9} n={entry['count']:<5} mean {entry['mean']:.3f}  deciles {deciles}"
                )
        self.stdout.write(f"See `manage.py show_feature {job.analysis.sae_id} INDEX` or the job's page.")
