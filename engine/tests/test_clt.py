"""Cross-layer transcoders: the forward equals a hand-written one, circuit-tracer's files and
Gemma Scope 2's per-layer files read back the same CLT, and bad folders are refused by name."""

import pytest
import torch
from safetensors.torch import save_file

from engine.errors import EngineError
from engine.sae.clt import CltShape, CrossLayerTranscoder, load_clt, load_gemma_scope_2_clt, save_clt


def _random(activation="jumprelu", skip=False, n_layers=3, d_model=8, d_sae=16, seed=0):
    clt = CrossLayerTranscoder(CltShape(n_layers, d_model, d_sae, activation=activation, skip=skip))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in clt.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
        clt.threshold.abs_()
    return clt


@pytest.mark.parametrize("activation", ["relu", "jumprelu"])
def test_the_forward_equals_a_hand_written_one(activation):
    clt = _random(activation, skip=True)
    inputs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(layer)) for layer in range(3)]
    features = []
    for layer, x in enumerate(inputs):
        pre = x @ clt.W_enc[layer] + clt.b_enc[layer]
        features.append(pre.relu() if activation == "relu" else pre * (pre > clt.threshold[layer]))
    expected = [
        sum(features[source] @ clt.W_dec[source][:, layer - source] for source in range(layer + 1))
        + clt.b_dec[layer]
        + inputs[layer] @ clt.W_skip[layer]
        for layer in range(3)
    ]
    for ours, theirs in zip(clt(inputs), expected, strict=True):
        assert torch.allclose(ours, theirs, atol=1e-5)


@pytest.mark.parametrize("activation", ["relu", "jumprelu"])
def test_circuit_tracers_layout_round_trips(tmp_path, activation):
    clt = _random(activation)
    save_clt(clt, tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        f"W_{kind}_{layer}.safetensors" for kind in ("dec", "enc") for layer in range(3)
    ]
    read = load_clt(tmp_path)
    assert read.shape == clt.shape
    for name, tensor in clt.state_dict().items():
        if name != "threshold" or activation == "jumprelu":
            assert torch.equal(read.state_dict()[name], tensor), name


def test_gemma_scope_2_files_read_as_the_same_clt(tmp_path):
    clt = _random("jumprelu", skip=True)
    paths = []
    for layer in range(3):
        into_every_layer = torch.zeros(16, 3, 8)
        into_every_layer[:, layer:] = clt.W_dec[layer].detach()
        path = tmp_path / f"layer_{layer}.safetensors"
        save_file(
            {
                "w_enc": clt.W_enc[layer].detach().clone(),
                "w_dec": into_every_layer,
                "b_enc": clt.b_enc[layer].detach().clone(),
                "b_dec": clt.b_dec[layer].detach().clone(),
                "threshold": clt.threshold[layer].detach().clone(),
                "affine_skip_connection": clt.W_skip[layer].detach().clone(),
            },
            path,
        )
        paths.append(path)
    read = load_gemma_scope_2_clt(paths)
    inputs = [torch.randn(4, 8) for _ in range(3)]
    for ours, theirs in zip(read(inputs), clt(inputs), strict=True):
        assert torch.allclose(ours, theirs, atol=1e-6)


def test_bad_folders_are_refused_by_name(tmp_path):
    with pytest.raises(EngineError, match=r"Not a CLT folder: W_enc_0\.safetensors"):
        load_clt(tmp_path)
    save_clt(_random(), tmp_path)
    (tmp_path / "W_dec_1.safetensors").unlink()
    with pytest.raises(EngineError, match="Not a CLT folder: W_dec_0"):
        load_clt(tmp_path)
    (tmp_path / "W_dec_1.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(EngineError, match=r"W_dec_1\.safetensors is not safetensors"):
        load_clt(tmp_path)
    with pytest.raises(EngineError, match="circuit-tracer's CLT files have no skip"):
        save_clt(_random(skip=True), tmp_path / "skip")
