"""``manage.py show_feature SAE INDEX``: one feature's dashboard in the terminal."""

from django.core.management.base import BaseCommand, CommandError

from features import selectors
from mistudio.access import OPERATOR
from mistudio.errors import ApplicationError
from saes.management.commandline import find_sae


def context_text(example: dict) -> str:
    """The example's tokens with the activating one in [brackets] and its value."""
    pieces = [
        f"[{token}]" if position == example["center"] else token
        for position, token in enumerate(example["tokens"])
    ]
    return "".join(pieces).replace("\n", "↵")


class Command(BaseCommand):
    help = "Show one feature of an SAE: statistics, top examples, logit effects and similar features."

    def add_arguments(self, parser):
        parser.add_argument("sae", help="SAE id (sae_…)")
        parser.add_argument("index", type=int, help="feature index")
        parser.add_argument("--analysis", help="analysis id (default: the newest completed one)")
        parser.add_argument("--examples", type=int, default=10)
        parser.add_argument(
            "--json", action="store_true", help="the dashboard data as JSON, as the API gives it"
        )

    def handle(self, *args, **options):
        sae = find_sae(options["sae"])
        try:
            analysis = selectors.current_analysis(user=OPERATOR, sae=sae, analysis_id=options["analysis"])
            detail = selectors.feature_detail(
                user=OPERATOR, sae=sae, analysis=analysis, index=options["index"]
            )
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        if options["json"]:
            import json

            self.stdout.write(json.dumps(detail, indent=2))
            return
        write = self.stdout.write
        label = detail["label"]["label"] if detail["label"] else ""
        write(f"Feature {detail['index']} of {sae.id} ({sae.hook_name})  {label or detail['auto_label']}")
        write(
            f"density {detail['density']:.3%}  max {detail['max_activation']:.4g}  "
            f"mean {detail['mean_activation']:.4g}  over {detail['tokens']:,} tokens"
        )
        write("\nTop activations:")
        for example in detail["top_examples"][: options["examples"]]:
            write(f"  {example['value']:8.4f}  {context_text(example)}")
        if detail["logit_effects"]:
            promoted = ", ".join(f"{e['token']!r} {e['value']:+.3f}" for e in detail["logit_effects"]["top"])
            suppressed = ", ".join(
                f"{e['token']!r} {e['value']:+.3f}" for e in detail["logit_effects"]["bottom"]
            )
            write(f"\nPromotes:   {promoted}\nSuppresses: {suppressed}")
        similar = ", ".join(f"{e['index']} ({e['cosine']:.2f})" for e in detail["similar"])
        write(f"\nSimilar features (decoder cosine): {similar}")
