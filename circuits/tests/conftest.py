"""Circuit test fixtures: completed transcoder rows (one per layer of a model, random weights saved
in SAELens' transcoder layout), as a training or an import leaves them."""

from types import SimpleNamespace

from transformers import AutoConfig

from engine.sae.formats import save_saelens
from engine.testing.tiny_saes import random_transcoders
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
