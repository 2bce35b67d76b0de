"""SAELens folders against the real SAELens: what ``save_saelens`` writes, ``sae_lens`` loads with
the same encodings, and what ``sae_lens`` saves, ``load_saelens`` reads with the same encodings
and hook names.

``sae_lens`` lives in the benchmark environment (bench/requirements-bench.txt), not in the
application's, so this module skips in ``make test``; .ci/run runs it in ``.venv-bench``, where
it is the real check of the format.
"""

import pytest
import torch

sae_lens = pytest.importorskip(
    "sae_lens", reason="sae-lens is in .venv-bench only; .ci/run runs this module there"
)

from sae_lens.saes.sae import SAEMetadata  # noqa: E402  (after the skip)

from engine.sae import SaeShape, SparseAutoencoder  # noqa: E402
from engine.sae.formats import load_saelens, save_saelens  # noqa: E402

D_IN, D_SAE, K = 16, 64, 8
TOLERANCE = 1e-5
# The engine's architecture, the SAELens class that reads it (batchtopk is saved as its
# inference form, a JumpReLU with one learnt threshold).
OURS_AS_SAELENS = {
    "standard": "StandardSAE",
    "topk": "TopKSAE",
    "jumprelu": "JumpReLUSAE",
    "batchtopk": "JumpReLUSAE",
}


def _inputs(seed: int = 3) -> torch.Tensor:
    return torch.randn(64, D_IN, generator=torch.Generator().manual_seed(seed)) * 2


def _fill_randomly(module: torch.nn.Module, *, seed: int) -> None:
    """Random weights and biases; a positive threshold, set so that about half the rows' features
    clear it (a JumpReLU that fires on nothing or everything would test little)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
            parameter = getattr(module, name)
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
        if hasattr(module, "threshold"):
            module.threshold.copy_(torch.rand(D_SAE, generator=generator) * 4 + 0.1)


def _assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    difference = float((ours - theirs).abs().max())
    assert difference <= TOLERANCE, f"max abs difference {difference:.2e}"


def _assert_same_sae(ours: SparseAutoencoder, theirs, x: torch.Tensor) -> None:
    with torch.no_grad():
        our_features, their_features = ours.encode(x), theirs.encode(x)
        assert (our_features > 0).any() and (our_features == 0).any()  # neither dead nor dense
        _assert_close(our_features, their_features)
        _assert_close(ours(x), theirs(x))
        _assert_close(ours.decode(our_features), theirs.decode(their_features))


@pytest.mark.parametrize("architecture", ["standard", "topk", "jumprelu", "batchtopk"])
@pytest.mark.parametrize("apply_b_dec", [True, False])
def test_a_folder_written_here_loads_in_saelens_with_the_same_encodings(architecture, apply_b_dec, tmp_path):
    k = K if architecture in ("topk", "batchtopk") else None
    ours = SparseAutoencoder(SaeShape(architecture, D_IN, D_SAE, k, apply_b_dec_to_input=apply_b_dec))
    _fill_randomly(ours, seed=1)
    folder = save_saelens(ours, tmp_path / "sae", hook_name="hook_embed", model_name="tiny-gpt2")

    theirs = sae_lens.SAE.load_from_disk(folder)

    assert type(theirs).__name__ == OURS_AS_SAELENS[architecture]
    assert theirs.cfg.apply_b_dec_to_input is apply_b_dec
    if architecture == "topk":
        assert theirs.cfg.k == K
    assert theirs.cfg.metadata.hook_name == "blocks.0.hook_resid_pre"
    assert theirs.cfg.metadata.model_name == "tiny-gpt2"
    _assert_same_sae(ours, theirs, _inputs())


def _saelens_sae(architecture: str, *, hook_name: str, apply_b_dec: bool = True):
    configs = {
        "standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig, {}),
        "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig, {"k": K}),
        "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig, {}),
    }
    sae_class, config_class, extra = configs[architecture]
    config = config_class(
        d_in=D_IN,
        d_sae=D_SAE,
        apply_b_dec_to_input=apply_b_dec,
        metadata=SAEMetadata(model_name="gpt2", hook_name=hook_name, hook_head_index=None),
        **extra,
    )
    sae = sae_class(config)
    _fill_randomly(sae, seed=2)
    return sae


@pytest.mark.parametrize("architecture", ["standard", "topk", "jumprelu"])
@pytest.mark.parametrize("apply_b_dec", [True, False])
def test_a_folder_saelens_saves_is_read_here_with_the_same_encodings(architecture, apply_b_dec, tmp_path):
    theirs = _saelens_sae(architecture, hook_name="blocks.3.hook_resid_post", apply_b_dec=apply_b_dec)
    theirs.save_model(tmp_path / "sae")

    ours, info = load_saelens(tmp_path / "sae")

    assert ours.architecture == architecture
    assert ours.shape.apply_b_dec_to_input is apply_b_dec
    assert ours.shape.k == (K if architecture == "topk" else None)
    assert info["hook_name"] == "blocks.3.hook_resid_post"
    assert info["model_name"] == "gpt2"
    _assert_same_sae(ours, theirs, _inputs())


@pytest.mark.parametrize(
    ("saelens_hook", "mistudio_hook"),
    [
        ("blocks.0.hook_resid_pre", "hook_embed"),
        ("blocks.0.hook_resid_post", "blocks.0.hook_resid_post"),
        ("blocks.2.mlp.hook_post", "blocks.2.mlp.hook_post"),
        ("ln_final.hook_normalized", "ln_final.hook_normalized"),
    ],
)
def test_hook_and_model_names_survive_both_ways(saelens_hook, mistudio_hook, tmp_path):
    _saelens_sae("standard", hook_name=saelens_hook).save_model(tmp_path / "from-saelens")
    ours, info = load_saelens(tmp_path / "from-saelens")
    assert (info["hook_name"], info["model_name"]) == (mistudio_hook, "gpt2")

    save_saelens(ours, tmp_path / "from-here", hook_name=info["hook_name"], model_name=info["model_name"])
    theirs = sae_lens.SAE.load_from_disk(tmp_path / "from-here")
    assert (theirs.cfg.metadata.hook_name, theirs.cfg.metadata.model_name) == (saelens_hook, "gpt2")


def test_a_topk_saelens_trained_and_saved_for_inference_is_read(tmp_path):
    """SAELens 6 trains TopK with ``rescale_acts_by_decoder_norm`` on by default and its runner
    saves ``save_inference_model``: norms folded into the weights, the flag still true in cfg."""
    trained = sae_lens.TopKTrainingSAE(sae_lens.TopKTrainingSAEConfig(d_in=D_IN, d_sae=D_SAE, k=K))
    _fill_randomly(trained, seed=4)
    with torch.no_grad():  # decoder rows of norm 0.5 to 1.5, as training leaves them
        trained.W_dec.mul_((torch.rand(D_SAE, 1) + 0.5) / trained.W_dec.norm(dim=1, keepdim=True))
    trained.save_inference_model(tmp_path / "sae")
    theirs = sae_lens.SAE.load_from_disk(tmp_path / "sae")
    assert theirs.cfg.rescale_acts_by_decoder_norm

    ours, _ = load_saelens(tmp_path / "sae")

    _assert_same_sae(ours, theirs, _inputs())
