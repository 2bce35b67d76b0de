"""Transcoders: spliced in place of an MLP, the model computes what a hand-written forward with the
transcoder as its MLP computes; they save as SAELens' transcoder classes and circuit-tracer's
per-layer files; Matryoshka prefixes reconstruct on their own."""

import math

import pytest
import torch
from safetensors.torch import load_file

from engine.sae import SaeShape, SparseAutoencoder, TrainingConfig, shuffled_batches, train
from engine.sae.evaluation import ce_loss_recovered, evaluate_activations
from engine.sae.formats import load_saelens, save_circuit_tracer, save_saelens
from engine.testing.references import summed_next_token_loss

WIDTH, D_SAE = 64, 96


def _transcoder(architecture="jumprelu", *, skip=True, seed=3) -> SparseAutoencoder:
    generator = torch.Generator().manual_seed(seed)
    sae = SparseAutoencoder(SaeShape(architecture, WIDTH, D_SAE, 8 if architecture == "topk" else None,
                                     apply_b_dec_to_input=False, d_out=WIDTH, skip=skip))  # fmt: skip
    with torch.no_grad():
        for tensor in sae.parameters():
            tensor.copy_(torch.randn(tensor.shape, generator=generator) / math.sqrt(WIDTH))
        sae.threshold.fill_(0.05)
    return sae


def test_a_transcoder_spliced_for_the_mlp_equals_a_hand_written_forward_with_it_as_the_mlp(load_tiny):
    weights = load_tiny("gpt2")
    model, tokenizer = weights.model, weights.tokenizer
    transcoder = _transcoder()
    sequences = [tokenizer("The cat sat on the mat and looked at the door.")["input_ids"],
                 tokenizer("A short one.")["input_ids"]]  # fmt: skip
    measured = ce_loss_recovered(
        model, sequences, hook_name="blocks.1.hook_mlp_out", input_hook="blocks.1.ln2.hook_normalized",
        sae=transcoder,
    )  # fmt: skip
    # By hand: block 1's MLP module replaced by the transcoder (which reads ln_2's output).
    mlp = model.transformer.h[1].mlp
    original = mlp.forward
    mlp.forward = lambda hidden_states: transcoder(hidden_states)
    try:
        total, tokens = summed_next_token_loss(model, sequences)
    finally:
        mlp.forward = original
    assert measured.tokens == tokens
    assert measured.sae_loss == pytest.approx(total / tokens, abs=1e-5)
    assert measured.sae_loss != pytest.approx(measured.clean_loss, abs=1e-3)  # the splice did something


def test_a_skip_transcoder_round_trips_through_saelens_and_writes_circuit_tracer_files(tmp_path):
    transcoder = _transcoder()
    save_saelens(transcoder, tmp_path / "tc", hook_name="blocks.1.ln2.hook_normalized",
                 hook_name_out="blocks.1.hook_mlp_out", model_name="tiny")  # fmt: skip
    loaded, described = load_saelens(tmp_path / "tc")
    assert described["cfg"]["architecture"] == "jumprelu_skip_transcoder"
    assert described["cfg"]["apply_b_dec_to_input"] is False and described["cfg"]["d_out"] == WIDTH
    assert described["hook_name_out"] == "blocks.1.hook_mlp_out"
    x = torch.randn(5, WIDTH)
    torch.testing.assert_close(loaded(x), transcoder(x), atol=0, rtol=0)
    path = save_circuit_tracer(transcoder, tmp_path / "ct", layer=1)
    tensors = load_file(path)
    assert path.name == "layer_1.safetensors"
    assert {name: tuple(t.shape) for name, t in tensors.items()} == {
        "W_enc": (D_SAE, WIDTH), "W_dec": (D_SAE, WIDTH), "b_enc": (D_SAE,), "b_dec": (WIDTH,),
        "W_skip": (WIDTH, WIDTH), "activation_function.threshold": (D_SAE,),
    }  # fmt: skip
    # circuit-tracer's forward: relu(F.linear(x, W_enc, b_enc)) above the threshold, decoded, plus x W_skip^T.
    pre = torch.nn.functional.linear(x, tensors["W_enc"], tensors["b_enc"])
    acts = pre.relu() * (pre > tensors["activation_function.threshold"])
    expected = acts @ tensors["W_dec"] + tensors["b_dec"] + x @ tensors["W_skip"].T
    torch.testing.assert_close(expected, transcoder(x), atol=1e-5, rtol=1e-5)


def _planted(rows, seed=0):
    """Sparse codes over 32 directions, of which the first 4 fire far more often."""
    generator = torch.Generator().manual_seed(seed)
    atoms = torch.randn(32, 16, generator=generator)
    rates = torch.tensor([0.5] * 4 + [0.04] * 28)
    codes = torch.rand(rows, 32, generator=generator) * (torch.rand(rows, 32, generator=generator) < rates)
    return codes @ atoms


def test_matryoshka_prefixes_reconstruct_on_their_own_better_than_a_plain_batchtopks():
    data, held_out = _planted(8192 + 2048).split([8192, 2048])
    results = {}
    for architecture, widths in (("matryoshka_batchtopk", (4, 16)), ("batchtopk", None)):
        config = TrainingConfig(
            architecture=architecture, d_sae=64, k=4, lr=3e-3, batch_size=256, total_tokens=8192 * 4,
            warmup_steps=5, dead_after_steps=20, matryoshka_widths=widths,
        )  # fmt: skip
        chunks = [data[start : start + 1024] for start in range(0, len(data), 1024)] * 4
        trained = train(shuffled_batches(chunks, batch_size=256, buffer_rows=2048), d_in=16, config=config,
                        sample=data[:2048])  # fmt: skip
        sae = trained.sae
        with torch.no_grad():
            features = sae.encode(held_out)
            prefix = features[:, :4] @ sae.W_dec[:4] + sae.b_dec
        total = (held_out - held_out.mean(0)).pow(2).sum()
        results[architecture] = float(1 - (prefix - held_out).pow(2).sum() / total)
        full = evaluate_activations(sae, [held_out]).explained_variance
        assert full > 0.8, (architecture, full)
    # The 4-feature prefix of the Matryoshka SAE alone explains far more than a plain one's first 4.
    assert results["matryoshka_batchtopk"] > results["batchtopk"] + 0.1, results
    # It saves as the JumpReLU it is at inference.
    assert sae.tensors().keys() >= {"threshold"}


def test_a_transcoder_set_round_trips_through_circuit_tracers_layout(tmp_path):
    from engine.sae.formats import SaeFormatError, load_circuit_tracer, save_circuit_tracer_set

    saved = [_transcoder("jumprelu", skip=True, seed=4), _transcoder("jumprelu", skip=True, seed=5)]
    folder = save_circuit_tracer_set(saved, tmp_path / "set", model_name="tiny", scan="tiny-set")
    loaded, meta = load_circuit_tracer(folder)
    assert meta == {"model_name": "tiny", "scan": "tiny-set"}
    for before, after in zip(saved, loaded, strict=True):
        assert after.shape == before.shape
        for name, tensor in before.tensors().items():
            assert torch.equal(after.tensors()[name], tensor), name
    # Without config.yaml the layer files are enough (ReLU when there is no threshold).
    (folder / "config.yaml").unlink()
    assert len(load_circuit_tracer(folder)[0]) == 2
    # Files outside the folder, downloads and cross-layer transcoders are refused.
    for config, code in (
        ("transcoders: [../elsewhere.safetensors]", "INVALID_SAE"),
        ("transcoders: ['hf://someone/transcoders/layer_0.safetensors']", "INVALID_SAE"),
        ("model_kind: cross_layer_transcoder", "UNSUPPORTED_SAE"),
        ("feature_input_hook: hook_resid_mid", "UNSUPPORTED_SAE"),
        ("[not, a, mapping]", "INVALID_SAE"),
    ):
        (folder / "config.yaml").write_text(config)
        with pytest.raises(SaeFormatError) as refused:
            load_circuit_tracer(folder)
        assert refused.value.code == code, config
    with pytest.raises(SaeFormatError):
        load_circuit_tracer(tmp_path)
