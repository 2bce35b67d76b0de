"""Sparse autoencoders in the engine: encodings against hand-written references, the shuffle
buffer, folding the normalisation, and training that recovers a planted dictionary."""

import pytest
import torch

from engine.sae import (
    SaeShape,
    SparseAutoencoder,
    TrainingConfig,
    explained_variance,
    shuffled_batches,
    train,
)
from engine.sae.training import fold_scaling, geometric_median

D_IN, D_SAE = 8, 24


def _random_sae(architecture: str, *, k: int | None = None, apply_b_dec: bool = True) -> SparseAutoencoder:
    generator = torch.Generator().manual_seed(1)
    sae = SparseAutoencoder(SaeShape(architecture, D_IN, D_SAE, k, apply_b_dec_to_input=apply_b_dec))
    with torch.no_grad():
        for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
            parameter = getattr(sae, name)
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
        sae.threshold.copy_(torch.rand(D_SAE, generator=generator))
    return sae


def _reference_pre(sae, x, apply_b_dec=True):
    """h_j = sum_i (x_i - b_dec_i) W_enc[i, j] + b_enc_j, written out one feature at a time."""
    rows = []
    for row in x.tolist():
        shifted = [value - (sae.b_dec[i].item() if apply_b_dec else 0.0) for i, value in enumerate(row)]
        rows.append(
            [
                sum(shifted[i] * sae.W_enc[i, j].item() for i in range(D_IN)) + sae.b_enc[j].item()
                for j in range(D_SAE)
            ]
        )
    return torch.tensor(rows)


@pytest.mark.parametrize("architecture", ["standard", "topk", "jumprelu", "batchtopk"])
@pytest.mark.parametrize("apply_b_dec", [True, False])
def test_encode_and_decode_match_a_hand_written_reference(architecture, apply_b_dec):
    k = 5 if architecture in ("topk", "batchtopk") else None
    sae = _random_sae(architecture, k=k, apply_b_dec=apply_b_dec)
    x = torch.randn(6, D_IN, generator=torch.Generator().manual_seed(2))
    pre = _reference_pre(sae, x, apply_b_dec)
    expected = []
    for row in pre.tolist():
        if architecture == "standard":
            expected.append([max(value, 0.0) for value in row])
        elif architecture == "topk":
            kept = sorted(range(D_SAE), key=lambda j: row[j], reverse=True)[:k]
            expected.append([max(row[j], 0.0) if j in kept else 0.0 for j in range(D_SAE)])
        else:  # jumprelu, and batchtopk's inference form
            expected.append(
                [
                    value if value > sae.threshold[j].item() and value > 0 else 0.0
                    for j, value in enumerate(row)
                ]
            )
    expected = torch.tensor(expected)
    with torch.no_grad():
        features = sae.encode(x)
        torch.testing.assert_close(features, expected, atol=1e-5, rtol=1e-5)
        decoded = [
            [
                sum(f[j] * sae.W_dec[j, i].item() for j in range(D_SAE)) + sae.b_dec[i].item()
                for i in range(D_IN)
            ]
            for f in expected.tolist()
        ]
        torch.testing.assert_close(sae.decode(features), torch.tensor(decoded), atol=1e-4, rtol=1e-5)


def test_topk_keeps_exactly_k_and_batchtopk_k_per_row_on_average():
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(32, D_SAE, generator=generator).abs() + 0.1  # all positive
    topk = _random_sae("topk", k=4).activate(hidden)
    assert ((topk > 0).sum(-1) == 4).all()
    batch = _random_sae("batchtopk", k=4).activate(hidden, training=True)
    assert int((batch > 0).sum()) == 4 * 32
    assert (
        batch.max() == hidden.max() and batch[batch > 0].min() >= hidden.flatten().topk(4 * 32).values.min()
    )


def test_jumprelu_fires_strictly_above_its_threshold():
    sae = _random_sae("jumprelu")
    with torch.no_grad():
        sae.threshold.fill_(0.5)
    hidden = torch.tensor([[0.5, 0.5001, 0.4999, -1.0] + [0.0] * (D_SAE - 4)])
    out = sae.activate(hidden)
    assert out[0, :4].tolist() == [0.0, pytest.approx(0.5001), 0.0, 0.0]


def test_the_shuffle_buffer_gives_every_row_once_mixed_and_in_bounded_batches():
    rows = torch.arange(1000, dtype=torch.float32)[:, None].repeat(1, 3)
    chunks = [rows[start : start + 100] for start in range(0, 1000, 100)]
    batches = list(shuffled_batches(chunks, batch_size=64, buffer_rows=256, seed=0))
    seen = torch.cat(batches)[:, 0]
    assert sorted(seen.tolist()) == list(range(1000))
    assert all(len(batch) == 64 for batch in batches[:-1]) and 0 < len(batches[-1]) <= 64
    # Mixed: the first batch draws from more than one chunk, and the order is not the cache's.
    assert len({int(value) // 100 for value in batches[0][:, 0]}) > 1
    assert seen.tolist() != sorted(seen.tolist())


def test_folding_the_scaling_factor_keeps_every_encoding_on_raw_activations():
    sae = _random_sae("topk", k=5)
    x = torch.randn(10, D_IN, generator=torch.Generator().manual_seed(4)) * 7
    scaling = 0.37
    with torch.no_grad():
        features_scaled = sae.encode(x * scaling)
        recon_raw = sae.decode(features_scaled) / scaling
        fold_scaling(sae, scaling)
        torch.testing.assert_close(sae.encode(x), features_scaled, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sae(x), recon_raw, atol=1e-5, rtol=1e-5)


def test_the_geometric_median_resists_outliers():
    points = torch.cat([torch.zeros(20, 2), torch.tensor([[1000.0, 1000.0]])])
    assert geometric_median(points).norm() < 1.0 < points.mean(0).norm()


def _dictionary(d_in=32, atoms=64, seed=0):
    dictionary = torch.randn(atoms, d_in, generator=torch.Generator().manual_seed(seed))
    return dictionary / dictionary.norm(dim=1, keepdim=True)


def _planted(dictionary, active=3, rows=60_000, seed=0):
    """Rows that are sparse combinations of the dictionary's unit atoms, ``active`` at a time."""
    generator = torch.Generator().manual_seed(seed)
    atoms = len(dictionary)
    chosen = torch.rand(rows, atoms, generator=generator).argsort(dim=1)[:, :active]
    magnitudes = torch.rand(rows, active, generator=generator) + 0.5
    codes = torch.zeros(rows, atoms).scatter(1, chosen, magnitudes)
    return codes @ dictionary


def _mean_max_cosine(learnt: torch.Tensor, true: torch.Tensor) -> float:
    learnt = learnt / learnt.norm(dim=1, keepdim=True).clamp(min=1e-8)
    return float((true @ learnt.T).max(dim=1).values.mean())


@pytest.mark.parametrize(
    "architecture, epochs, options",
    [
        ("topk", 2, {"k": 3}),
        ("batchtopk", 2, {"k": 3}),
        # The penalised architectures need more steps to push the many features that a random
        # initialisation turns on below their threshold.
        ("jumprelu", 10, {"l0_coefficient": 0.5, "jumprelu_init_threshold": 0.5, "jumprelu_bandwidth": 0.2}),
        ("standard", 10, {"l1_coefficient": 1.0}),
    ],
)
def test_training_recovers_a_planted_dictionary(architecture, epochs, options):
    dictionary = _dictionary()
    data = _planted(dictionary)
    config = TrainingConfig(
        architecture=architecture,
        d_sae=128,
        lr=4e-3,
        batch_size=512,
        total_tokens=len(data) * epochs,
        warmup_steps=20,
        dead_after_steps=50,
        **options,
    )
    chunks = [data[i : i + 4096] for _ in range(epochs) for i in range(0, len(data), 4096)]
    trained = train(
        shuffled_batches(chunks, batch_size=512, buffer_rows=8192),
        d_in=data.shape[1],
        config=config,
        sample=data[:2048],
    )
    score = _mean_max_cosine(trained.sae.W_dec.detach(), dictionary)
    assert score >= 0.9, f"{architecture}: mean max-cosine {score:.3f}"
    # The trained SAE (scaling folded in) reconstructs new rows of the same dictionary, raw.
    assert explained_variance(trained.sae, _planted(dictionary, rows=2048, seed=1)) > 0.8


# --- formats ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("architecture", ["standard", "topk", "jumprelu", "batchtopk"])
def test_a_saelens_folder_written_here_reads_back_with_the_same_encodings(architecture, tmp_path):
    import json

    from engine.sae.formats import load_saelens, save_saelens

    k = 5 if architecture in ("topk", "batchtopk") else None
    sae = _random_sae(architecture, k=k)
    folder = save_saelens(sae, tmp_path / "sae", hook_name="hook_embed", model_name="tiny-gpt2")
    cfg = json.loads((folder / "cfg.json").read_text())
    # SAELens 6's fields; the embedding is TransformerLens' blocks.0.hook_resid_pre.
    assert cfg["architecture"] == ("jumprelu" if architecture == "batchtopk" else architecture)
    assert (cfg["d_in"], cfg["d_sae"], cfg["metadata"]["hook_name"]) == (
        D_IN,
        D_SAE,
        "blocks.0.hook_resid_pre",
    )
    loaded, info = load_saelens(folder)
    assert (info["hook_name"], info["model_name"]) == ("hook_embed", "tiny-gpt2")
    x = torch.randn(7, D_IN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode(x), sae.encode(x), atol=1e-6, rtol=0)
        torch.testing.assert_close(loaded(x), sae(x), atol=1e-6, rtol=0)


def test_a_saelens_5_topk_config_is_read(tmp_path):
    import json

    from safetensors.torch import save_file

    from engine.sae.formats import load_saelens

    sae = _random_sae("topk", k=3)
    folder = tmp_path / "old"
    folder.mkdir()
    save_file(sae.tensors(), folder / "sae_weights.safetensors")
    (folder / "cfg.json").write_text(
        json.dumps(
            {
                "architecture": "standard",
                "activation_fn_str": "topk",
                "activation_fn_kwargs": {"k": 3},
                "d_in": D_IN,
                "d_sae": D_SAE,
                "hook_name": "blocks.1.hook_resid_post",
                "model_name": "gpt2",
                "apply_b_dec_to_input": True,
            }
        )
    )
    loaded, info = load_saelens(folder)
    assert (loaded.architecture, loaded.shape.k, info["hook_name"]) == ("topk", 3, "blocks.1.hook_resid_post")
    x = torch.randn(4, D_IN)
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode(x), sae.encode(x))


def test_a_gemma_scope_params_file_is_a_jumprelu_without_b_dec_on_the_input(tmp_path):
    import numpy as np

    from engine.sae.formats import load_gemma_scope

    reference = _random_sae("jumprelu", apply_b_dec=False)
    arrays = {name: tensor.numpy() for name, tensor in reference.tensors().items()}
    np.savez(tmp_path / "params.npz", **arrays)
    loaded = load_gemma_scope(tmp_path)
    x = torch.randn(5, D_IN)
    pre = _reference_pre(reference, x, apply_b_dec=False)
    expected = torch.where(pre > reference.threshold, pre.relu(), torch.zeros_like(pre))
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode(x), expected, atol=1e-5, rtol=1e-5)


def test_unreadable_or_inconsistent_folders_are_refused_with_a_code(tmp_path):
    import json

    import numpy as np

    from engine.sae.formats import SaeFormatError, load_gemma_scope, load_saelens, save_saelens

    with pytest.raises(SaeFormatError) as missing:
        load_saelens(tmp_path)
    assert missing.value.code == "INVALID_SAE"
    folder = save_saelens(_random_sae("standard"), tmp_path / "sae", hook_name="hook_embed", model_name="m")
    cfg = json.loads((folder / "cfg.json").read_text())
    (folder / "cfg.json").write_text(json.dumps({**cfg, "d_sae": D_SAE + 1}))
    with pytest.raises(SaeFormatError) as mismatch:
        load_saelens(folder)
    assert mismatch.value.code == "INVALID_SAE"
    (folder / "cfg.json").write_text(json.dumps({**cfg, "normalize_activations": "layer_norm"}))
    with pytest.raises(SaeFormatError) as unsupported:
        load_saelens(folder)
    assert unsupported.value.code == "UNSUPPORTED_SAE"
    # An .npz holding a pickled object is refused, never unpickled.
    np.savez(tmp_path / "params.npz", W_enc=np.array([{"x": 1}], dtype=object))
    with pytest.raises(SaeFormatError) as pickled:
        load_gemma_scope(tmp_path)
    assert pickled.value.code == "INVALID_SAE"


def test_the_default_dictionary_gives_each_feature_enough_tokens():
    from engine.sae import default_expansion

    assert default_expansion(768, 2_000_000) == 8  # GPT-2 small on a research-scale cache
    assert default_expansion(768, 500_000) == 4
    assert default_expansion(128, 57_986) == 4  # the demo cache: 512 features, 113 tokens each
    assert default_expansion(64, 100) == 1
