"""``manage.py attribute_prompt MODEL "prompt" (--transcoders SAE ... | --group GROUP)``: compute the
attribution graph of a prompt through one transcoder per layer (a worker runs the job; this follows
it with a progress bar), print its top logits and most influential features, and optionally write
the graph JSON that Neuronpedia's graph viewer and circuit-tracer's local server load."""

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from circuits import selectors, services
from mistudio.access import OPERATOR
from mistudio.errors import ApplicationError
from models_app.management.commandline import find_model, find_owner, follow_job
from saes.management.commandline import find_sae
from saes.models import SaeGroup


class Command(BaseCommand):
    help = "Compute a prompt's attribution graph through transcoders (circuit-tracer's method)."

    def add_arguments(self, parser):
        parser.add_argument("model", help="model id (m_…) or name")
        parser.add_argument("prompt")
        which = parser.add_mutually_exclusive_group(required=True)
        which.add_argument("--transcoders", nargs="+", help="one transcoder SAE id per layer, layer 0 first")
        which.add_argument("--group", help="an SAE group whose members include one MLP transcoder per layer")
        parser.add_argument("--max-feature-nodes", type=int, help="keep at most this many feature nodes")
        parser.add_argument("--batch-size", type=int, default=32)
        parser.add_argument("--name", default="")
        parser.add_argument("--owner", help="the user the graph belongs to (default: none, the operator's)")
        parser.add_argument("--export", help="write the graph's JSON (Neuronpedia / circuit-tracer) here")
        parser.add_argument("--no-wait", action="store_true")
        parser.add_argument("--timeout", type=float, default=6 * 3600)

    def handle(self, *args, **options):
        model = find_model(options["model"])
        owner = find_owner(options["owner"])
        if options["group"]:
            group = SaeGroup.objects.filter(pk=options["group"]).first()
            if group is None:
                raise CommandError(f"No SAE group {options['group']!r}.")
            transcoders = services.transcoders_of_group(group)
        else:
            transcoders = [find_sae(sae_id) for sae_id in options["transcoders"]]
        try:
            graph = services.graph_request(
                owner=owner, model=model, transcoders=transcoders, prompt=options["prompt"],
                max_feature_nodes=options["max_feature_nodes"], batch_size=options["batch_size"],
                name=options["name"],
            )  # fmt: skip
        except ApplicationError as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        if options["no_wait"]:
            self.stdout.write(f"Attribution graph {graph.id} queued")
            return
        follow_job(
            graph, stdout=self.stdout, timeout=options["timeout"], total=100, unit="%", what="graph",
            done=lambda row: row.progress, postfix=lambda row: "",
        )  # fmt: skip
        summary = graph.summary
        self.stdout.write(
            f"Attribution graph {graph.id} completed in {summary['seconds']:.1f} s: "
            f"{summary['active_features']} active features, {summary['feature_nodes']} kept, "
            f"{summary['pruned_nodes']} nodes after pruning; completeness error "
            f"{summary['completeness_error']:.1e}."
        )
        for logit in summary["logits"]:
            self.stdout.write(f"  {logit['token']!r:<16} p={logit['probability']:.3f}")
        if options["export"]:
            try:
                services.graph_view_prepare(graph=graph)
                body = selectors.graph_view(user=owner or OPERATOR, graph=graph, export=True)
            except ApplicationError as error:
                raise CommandError(f"{error.code}: {error.message}") from None
            Path(options["export"]).write_bytes(body)
            self.stdout.write(f"Graph JSON written to {options['export']}")
