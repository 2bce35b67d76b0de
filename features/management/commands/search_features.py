"""``manage.py search_features SAE "query"``: the features whose explanations or labels mean ``query``."""

from django.core.management.base import BaseCommand, CommandError

from features import selectors
from features.search import feature_search
from mistudio.access import OPERATOR
from mistudio.errors import ApplicationError
from saes.management.commandline import find_sae


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


class Command(BaseCommand):
    help = "Search an SAE's features by meaning: explanations and labels nearest a query, with cosines."

    def add_arguments(self, parser):
        parser.add_argument("sae", help="SAE id (sae_…)")
        parser.add_argument("query", help='what the features are about, e.g. "numbers in code"')
        parser.add_argument("--k", type=int, default=10, help="how many results (default 10)")
        parser.add_argument("--analysis", help="analysis id (default: the newest completed one)")

    def handle(self, *args, **options):
        sae = find_sae(options["sae"])
        try:
            analysis = selectors.current_analysis(user=OPERATOR, sae=sae, analysis_id=options["analysis"])
            found = feature_search(
                user=OPERATOR, sae=sae, analysis=analysis, query=options["query"], k=options["k"]
            )
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        write = self.stdout.write
        write(f"{len(found['results'])} results for {found['query']!r} in {analysis.id} ({sae.id})")
        if not found["results"]:
            return
        write(f"{'rank':>4}  {'feature':>7}  {'cosine':>7}  {'score':>6}  {'source':<11}  text")
        for rank, result in enumerate(found["results"], start=1):
            text = " ".join(result["text"].split())
            write(
                f"{rank:>4}  {result['index']:>7}  {result['cosine']:>7.4f}  {_number(result['score']):>6}  "
                f"{result['source']:<11}  {text}"
            )
