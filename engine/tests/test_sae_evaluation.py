"""SAE evaluation against references computed without it.

Held-out metrics: the same formulas on all the rows at once, and an SAE built so that which
features fire is known. CE loss recovered on real tiny models: transformers' own ``labels=``
loss of each sequence alone, plain torch hooks (not the engine's runtime) that zero or
reconstruct a module's output, and an SAE whose reconstruction is its input exactly.
"""

import json

import pytest
import torch

from engine.sae import SaeShape, SparseAutoencoder
from engine.sae.evaluation import (
    EvaluationCancelled,
    EvaluationError,
    ce_loss_recovered,
    evaluate_activations,
    log_feature_density,
)

D_IN, D_SAE = 8, 24
# Lengths of the token sequences: unequal, so batches are padded; 1 predicts nothing.
LENGTHS = (12, 5, 9, 1, 17, 2, 7)


def _random_sae(d_in=D_IN, d_sae=D_SAE, *, seed=1, scale=1.0) -> SparseAutoencoder:
    generator = torch.Generator().manual_seed(seed)
    sae = SparseAutoencoder(SaeShape("standard", d_in, d_sae))
    with torch.no_grad():
        for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
            parameter = getattr(sae, name)
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
        sae.b_enc[:3] = -1e4  # three features that cannot fire
    return sae


def _identity_sae(d_in: int) -> SparseAutoencoder:
    """relu(x) - relu(-x) = x: features [x+, x-], decoded as x+ - x-, exactly."""
    sae = SparseAutoencoder(SaeShape("standard", d_in, 2 * d_in))
    eye = torch.eye(d_in)
    with torch.no_grad():
        sae.W_enc.copy_(torch.cat([eye, -eye], dim=1))
        sae.W_dec.copy_(torch.cat([eye, -eye], dim=0))
    return sae


# --- held-out activations ---------------------------------------------------------------------


def _held_out_rows(rows=1000) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    # A large common offset, as residual streams have: a naive sum-of-squares variance loses it.
    return torch.randn(rows, D_IN, generator=generator) * torch.linspace(0.5, 3, D_IN) + 40.0


@pytest.mark.parametrize(("chunk_rows", "rows_per_step"), [(1000, 4096), (137, 4096), (250, 33), (1, 4096)])
def test_held_out_metrics_do_not_depend_on_the_chunking(chunk_rows, rows_per_step):
    x = _held_out_rows()
    sae = _random_sae()
    with torch.no_grad():
        sae.b_dec.fill_(40.0)  # centre the random SAE on the data, so features fire variously
        features = sae.encode(x)
        reconstruction = sae.decode(features)
    residual = (x.double() - reconstruction.double()).pow(2)
    variance = (x.double() - x.double().mean(0)).pow(2).sum()
    fired = features > 0
    density = fired.double().mean(0)

    result = evaluate_activations(
        sae, list(torch.split(x, chunk_rows)), dense_threshold=0.3, rows_per_step=rows_per_step
    )

    assert result.tokens == 1000
    assert result.mse == pytest.approx(float(residual.sum(-1).mean()), rel=1e-6)
    assert result.explained_variance == pytest.approx(float(1 - residual.sum() / variance), rel=1e-6)
    assert result.fraction_of_variance_unexplained == pytest.approx(1 - result.explained_variance)
    assert result.l0 == pytest.approx(float(fired.sum(-1).double().mean()), rel=1e-12)
    assert result.dead_features == int((density == 0).sum()) >= 3
    assert result.dense_features == int((density > 0.3).sum()) > 0
    torch.testing.assert_close(result.feature_density, density.float(), rtol=0, atol=0)


def test_dead_and_dense_features_of_an_sae_whose_firing_is_known():
    # Feature i < 4 is relu(x_i); features 4 and 5 have no weights and a negative bias.
    sae = SparseAutoencoder(SaeShape("standard", 4, 6))
    with torch.no_grad():
        sae.W_enc[:, :4].copy_(torch.eye(4))
        sae.b_enc[4:] = -1.0
        sae.W_dec[:4].copy_(torch.eye(4))
    rows = torch.full((20, 4), -1.0)
    rows[:, 0] = 2.0  # always fires
    rows[:10, 1] = 0.5  # half the rows
    rows[7, 2] = 3.0  # one row in twenty
    # Feature 3 (x_3 always negative), 4 and 5 never fire.
    result = evaluate_activations(sae, [rows[:6], rows[6:13], rows[13:]])
    assert result.feature_density.tolist() == pytest.approx([1.0, 0.5, 0.05, 0.0, 0.0, 0.0])
    assert result.dead_features == 3
    assert result.dense_features == 2
    assert evaluate_activations(sae, [rows], dense_threshold=0.04).dense_features == 3
    assert result.l0 == pytest.approx(1.55)
    # The reconstruction keeps the positive coordinates only: the error is the negative ones.
    assert result.mse == pytest.approx(float(rows.clamp(max=0).pow(2).sum(-1).mean()))
    logged = log_feature_density(result.feature_density)
    assert logged.tolist() == pytest.approx([0.0, -0.30103, -1.30103, -10.0, -10.0, -10.0], abs=1e-5)

    metrics = result.to_dict()
    assert json.loads(json.dumps(metrics)) == metrics
    assert "feature_density" not in metrics
    assert {type(value) for value in metrics.values()} <= {int, float}


def test_held_out_evaluation_refuses_no_rows_and_rows_of_another_width():
    sae = _random_sae()
    with pytest.raises(EvaluationError) as empty:
        evaluate_activations(sae, iter([torch.zeros(0, D_IN)]))
    assert empty.value.code == "NO_ACTIVATIONS"
    with pytest.raises(EvaluationError) as wrong:
        evaluate_activations(sae, [torch.zeros(3, D_IN + 1)])
    assert wrong.value.code == "WRONG_WIDTH"
    with pytest.raises(EvaluationCancelled):
        evaluate_activations(sae, [torch.zeros(3, D_IN)], should_cancel=lambda: True)


# --- CE loss recovered ------------------------------------------------------------------------


def _sequences(model) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    return [torch.randint(0, vocab, (length,), generator=generator).tolist() for length in LENGTHS]


def _reference_loss(model, sequences, module=None, replace=None) -> float:
    """Mean next-token loss, each sequence run alone (no padding) through transformers' own
    ``labels=`` loss, with ``module``'s output replaced by ``replace(output)`` by a plain hook."""
    handle = None
    if module is not None:

        def hook(module, args, output):
            if isinstance(output, tuple):
                return (replace(output[0]), *output[1:])
            return replace(output)

        handle = module.register_forward_hook(hook)
    total, count = 0.0, 0
    try:
        with torch.no_grad():
            for ids in sequences:
                if len(ids) < 2:
                    continue
                tensor = torch.tensor([ids])
                loss = model(input_ids=tensor, labels=tensor).loss
                total += float(loss) * (len(ids) - 1)
                count += len(ids) - 1
    finally:
        if handle is not None:
            handle.remove()
    return total / count


def _module(model, family: str, hook_name: str):
    """The module whose output is ``hook_name``, found here without engine.hooks."""
    blocks = model.transformer.h if family == "gpt2" else model.model.layers
    if hook_name == "hook_embed":  # GPT-2: block 0's input is the output of the embedding dropout
        return model.transformer.drop
    layer, kind = int(hook_name.split(".")[1]), hook_name.split(".", 2)[2]
    return blocks[layer] if kind == "hook_resid_post" else blocks[layer].mlp


def _no_runtime_hooks_left(model) -> bool:
    return not any(
        getattr(hook, "__module__", None) == "engine.runtime"
        for module in model.modules()
        for hook in (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
    )


@pytest.mark.parametrize(
    ("family", "hook_name"),
    [
        ("gpt2", "blocks.0.hook_resid_post"),
        ("gpt2", "blocks.1.hook_mlp_out"),
        ("gpt2", "hook_embed"),
        ("llama", "blocks.0.hook_resid_post"),
    ],
)
def test_ce_losses_match_one_sequence_at_a_time_references(family, hook_name, load_tiny):
    model = load_tiny(family).model
    sequences = _sequences(model)
    sae = _random_sae(model.config.hidden_size, 128, scale=0.2)
    module = _module(model, family, hook_name)

    result = ce_loss_recovered(model, sequences, hook_name=hook_name, sae=sae, batch_size=3)

    assert result.tokens == sum(length - 1 for length in LENGTHS)
    assert result.clean_loss == pytest.approx(_reference_loss(model, sequences), rel=1e-5)
    zero = _reference_loss(model, sequences, module, torch.zeros_like)
    assert result.zero_ablation_loss == pytest.approx(zero, rel=1e-5)
    with torch.no_grad():
        spliced = _reference_loss(model, sequences, module, sae)
    assert result.sae_loss == pytest.approx(spliced, rel=1e-5)
    assert len({result.clean_loss, result.sae_loss, result.zero_ablation_loss}) == 3
    assert result.ce_loss_recovered == pytest.approx(
        (result.zero_ablation_loss - result.sae_loss) / (result.zero_ablation_loss - result.clean_loss)
    )
    assert _no_runtime_hooks_left(model)

    one_at_a_time = ce_loss_recovered(model, sequences, hook_name=hook_name, sae=sae, batch_size=1)
    for key, value in one_at_a_time.to_dict().items():
        assert result.to_dict()[key] == pytest.approx(value, rel=1e-5), key


@pytest.mark.parametrize(("family", "quantization"), [("gpt2", "none"), ("llama", "none"), ("gpt2", "bf16")])
def test_an_exact_reconstruction_recovers_all_the_loss(family, quantization, load_tiny):
    model = load_tiny(family, quantization).model
    sequences = _sequences(model)
    sae = _identity_sae(model.config.hidden_size)
    result = ce_loss_recovered(model, sequences, hook_name="blocks.1.hook_resid_post", sae=sae, batch_size=4)
    assert result.sae_loss == pytest.approx(result.clean_loss, abs=1e-6)
    # Random weights predict about uniformly, so zero-ablating may even help; it only has to differ.
    assert abs(result.zero_ablation_loss - result.clean_loss) > 1e-3
    assert result.ce_loss_recovered == pytest.approx(1.0, abs=1e-5)
    assert json.loads(json.dumps(result.to_dict())) == result.to_dict()


def test_zero_ablating_the_llama_embedding_equals_zero_input_embeddings(load_tiny):
    # Llama adds no position embedding (rotary positions live in attention), so block 0's input
    # is the token embedding itself, and zeroing it is passing inputs_embeds of zeros.
    model = load_tiny("llama").model
    sequences = _sequences(model)
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in sequences[:3]:
            embeds = torch.zeros(1, len(ids), model.config.hidden_size)
            loss = model(inputs_embeds=embeds, labels=torch.tensor([ids])).loss
            total += float(loss) * (len(ids) - 1)
            count += len(ids) - 1
    sae = _identity_sae(model.config.hidden_size)
    result = ce_loss_recovered(model, sequences[:3], hook_name="hook_embed", sae=sae, batch_size=3)
    assert result.zero_ablation_loss == pytest.approx(total / count, rel=1e-5)


def test_ce_loss_recovered_refuses_bad_requests_and_stops_when_cancelled(load_tiny):
    model = load_tiny("gpt2").model
    sequences = _sequences(model)
    hidden = model.config.hidden_size
    with pytest.raises(EvaluationError) as width:
        ce_loss_recovered(model, sequences, hook_name="blocks.0.hook_resid_post", sae=_random_sae())
    assert width.value.code == "WRONG_WIDTH"
    with pytest.raises(EvaluationError) as nothing:
        ce_loss_recovered(model, [[1], []], hook_name="hook_embed", sae=_identity_sae(hidden))
    assert nothing.value.code == "NO_TOKENS"
    with pytest.raises(EvaluationError) as out_of_vocabulary:
        ce_loss_recovered(
            model, [[1, model.config.vocab_size]], hook_name="hook_embed", sae=_identity_sae(hidden)
        )
    assert out_of_vocabulary.value.code == "INVALID_TOKENS"
    with pytest.raises(EvaluationCancelled):
        ce_loss_recovered(
            model, sequences, hook_name="hook_embed", sae=_identity_sae(hidden), should_cancel=lambda: True
        )
    assert _no_runtime_hooks_left(model)
