"""Attribution graphs: how a model computes its next token on one prompt, through transcoders."""

from django.conf import settings
from django.db import models

from mistudio.identifiers import new_graph_id, new_subgraph_id
from mistudio.jobs import JobRow


class AttributionGraph(JobRow):
    """The attribution graph of one prompt through one transcoder per layer of a model
    (``engine.attribution``, circuit-tracer's method), in ``GRAPH_DIR/<id>/`` (``graph.safetensors``
    and ``graph.json``). Computed by a job on the model's worker:
    ``queued → running → completed | failed | cancelled``. The owner's view of it (pinned nodes,
    named supernodes, prune thresholds) is kept on the row; it is shown to others only when shared.
    """

    kind = "graph"
    task = "circuits.tasks.run_attribution"
    noun = "attribution graph"
    failure_code = "ATTRIBUTION_FAILED"
    OWNER_FIELDS = ("name", "shared", "pinned", "supernodes", "node_threshold", "edge_threshold")

    id = models.CharField(primary_key=True, max_length=64, default=new_graph_id, editable=False)
    name = models.CharField(max_length=500, blank=True)
    model = models.ForeignKey(
        "models_app.LanguageModel", null=True, on_delete=models.SET_NULL, related_name="graphs"
    )
    transcoders = models.JSONField(
        default=list, help_text="The transcoder SAE ids, layer 0 first (one per layer)"
    )
    prompt = models.TextField()
    tokens = models.JSONField(default=list, blank=True, help_text="The token ids attributed")
    token_strings = models.JSONField(default=list, blank=True)
    config = models.JSONField(default=dict, blank=True, help_text="engine.attribution.AttributionConfig")
    summary = models.JSONField(default=dict, blank=True, help_text="Node counts, completeness, timings")
    pinned = models.JSONField(default=list, blank=True, help_text="Pinned node ids")
    supernodes = models.JSONField(default=list, blank=True, help_text="[name, node id, ...] groups")
    node_threshold = models.FloatField(default=0.8)
    edge_threshold = models.FloatField(default=0.98)
    shared = models.BooleanField(default=False, help_text="Visible to every reader (its prompt included)")

    class Meta(JobRow.Meta):
        pass

    def __str__(self) -> str:
        return f"{self.id} ({self.name or self.prompt[:40]})"

    def event_groups(self) -> list[str]:
        return [f"graph.{self.id}", *([f"model.{self.model_id}"] if self.model_id else [])]

    @property
    def directory(self):
        return settings.GRAPH_DIR / self.id

    def mark_progress(self, *, done: int, total: int) -> list[str]:
        self.progress = round(100 * done / max(1, total), 2)
        return ["progress"]

    def mark_completed(self, *, summary: dict) -> list[str]:
        self.summary = summary
        return [*super().mark_completed(), "summary"]


class Subgraph(models.Model):
    """A researcher's saved reading of a graph: its pinned nodes, named supernodes, prune thresholds,
    a name, notes and per-node annotations (node id to text, shown as the node's label). Seen by
    its owner, and by those who may see its graph once shared. Exported in Neuronpedia's subgraph
    form (``selectors.subgraph_export``)."""

    OWNER_FIELDS = ("name", "notes", "annotations", "pinned", "supernodes", "node_threshold",
                    "edge_threshold", "shared")  # fmt: skip

    id = models.CharField(primary_key=True, max_length=64, default=new_subgraph_id, editable=False)
    graph = models.ForeignKey(AttributionGraph, on_delete=models.CASCADE, related_name="subgraphs")
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    name = models.CharField(max_length=500)
    notes = models.TextField(blank=True)
    annotations = models.JSONField(default=dict, blank=True, help_text="Node id to the owner's note on it")
    pinned = models.JSONField(default=list, blank=True, help_text="Pinned node ids")
    supernodes = models.JSONField(default=list, blank=True, help_text="[name, node id, ...] groups")
    node_threshold = models.FloatField(default=0.8)
    edge_threshold = models.FloatField(default=0.98)
    shared = models.BooleanField(default=False, help_text="Visible to whoever may see its graph")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.id} ({self.name})"
