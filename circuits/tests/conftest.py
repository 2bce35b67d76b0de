"""Circuit test fixtures: completed transcoder rows (one per layer of a model, random weights saved
in SAELens' transcoder layout), as a training or an import leaves them, and a graph computed
through the API by a burst worker."""

from types import SimpleNamespace

from transformers import AutoConfig

from circuits.models import AttributionGraph
from engine.sae.formats import save_saelens
from engine.testing.tiny_saes import random_transcoders
from mistudio.workers import run_worker
from saes.models import SparseAutoencoder as SaeRow
from saes.services import folder_size


def transcoder_rows(model, folder, owner, *, shared: bool = False, seed: int = 3, architecture="jumprelu"):
    """One completed MLP transcoder row per layer of ``model`` (whose files are in ``folder``)."""
    config = AutoConfig.from_pretrained(folder)
    rows = []
    modules = random_transcoders(SimpleNamespace(config=config), architecture, skip=True, seed=seed)
    for layer, module in enumerate(modules):
        hook, hook_out = f"blocks.{layer}.ln2.hook_normalized", f"blocks.{layer}.hook_mlp_out"
        sae = SaeRow(
            name=f"transcoder {layer}",
            model=model,
            model_name=model.display_identifier,
            hook_name=hook,
            hook_name_out=hook_out,
            architecture=architecture,
            d_in=module.shape.d_in,
            d_sae=module.shape.d_sae,
            d_out=module.shape.d_out,
            status=SaeRow.Status.COMPLETED,
            progress=100,
            owner=owner,
            shared=shared,
        )
        save_saelens(module, sae.directory, hook_name=hook, model_name=sae.model_name, hook_name_out=hook_out)
        sae.file_size_bytes = folder_size(sae.directory)
        sae.save()
        rows.append(sae)
    return rows


def computed_graph(api, model, transcoders, *, worker: str, prompt: str, **fields) -> AttributionGraph:
    """A graph of ``prompt`` asked through the API by ``api``'s user and computed by the burst
    worker ``worker`` (where ``model`` is loaded)."""
    body = {"model_id": model.id, "prompt": prompt, "transcoder_ids": [sae.id for sae in transcoders],
            "batch_size": 16, **fields}  # fmt: skip
    response = api.post("/api/graphs", body, format="json")
    assert response.status_code == 202, response.content
    run_worker(name=worker, device="cpu", burst=True)
    graph = AttributionGraph.objects.get(pk=response.json()["id"])
    assert graph.status == "completed", (graph.error_code, graph.error_message)
    return graph
