"""Training a cross-layer transcoder on a tiny model's MLPs: the loss falls, every layer explains
its MLP's output, TopK keeps k features a layer, the JumpReLU recipe's tanh penalty lowers L0, a
resumed run equals an uninterrupted one, and CE loss recovered with every MLP replaced at once is
checked against a hand-written replaced forward."""

import pytest
import torch

from engine.sae.checkpoint import TrainingCheckpoint
from engine.sae.clt_training import (
    CltTrainer,
    CltTrainingConfig,
    ce_loss_recovered_all_mlps,
    clt_explained_variance,
    mlp_rows,
)
from engine.testing.tiny_models import local_corpus


@pytest.fixture(scope="module")
def rows(load_tiny):
    weights = load_tiny("gpt2")
    texts = local_corpus(30_000)[:120]
    batches = [torch.tensor([weights.tokenizer(text)["input_ids"][:48]]) for text in texts]
    batches = [batch for batch in batches if batch.shape[1] > 8]
    inputs, outputs = mlp_rows(weights.model, batches)
    return weights, batches, inputs, outputs


def _train(inputs, outputs, config, steps, trainer=None):
    trainer = trainer or CltTrainer(config, sample_inputs=inputs[:2048], sample_outputs=outputs[:2048])
    generator = torch.Generator().manual_seed(trainer.step_count)
    history = []
    for _ in range(steps):
        picked = torch.randint(len(inputs), (config.batch_size,), generator=generator)
        history.append(trainer.step(inputs[picked], outputs[picked]))
    return trainer, history


def test_a_topk_clt_learns_every_layer_and_keeps_k_features(rows):
    _, _, inputs, outputs = rows
    config = CltTrainingConfig(d_sae=128, k=8, lr=3e-3, steps=150, batch_size=128, warmup_steps=10)
    trainer, history = _train(inputs, outputs, config, 150)
    assert history[-1].mse < 0.5 * history[0].mse
    with torch.no_grad():
        per_layer = (trainer.encode(inputs[:512]) > 0).float().sum(-1).mean(0)
    assert all(6 <= float(l0) <= 8 for l0 in per_layer)  # k, less where fewer are positive
    clt = trainer.finish(inputs[:2048]).sae
    explained = clt_explained_variance(clt, inputs[-1024:], outputs[-1024:])
    assert all(value > 0.3 for value in explained), explained


def test_the_tanh_penalty_lowers_l0(rows):
    _, _, inputs, outputs = rows
    l0 = {}
    for coefficient in (0.0, 0.5):
        config = CltTrainingConfig(d_sae=128, sparsity="jumprelu", k=None, sparsity_coefficient=coefficient,
                                   lr=3e-3, batch_size=128, warmup_steps=10)  # fmt: skip
        _, history = _train(inputs, outputs, config, 250)
        l0[coefficient] = history[-1].l0
    assert l0[0.5] < 0.7 * l0[0.0], l0


def test_a_resumed_run_equals_an_uninterrupted_one(rows, tmp_path):
    _, _, inputs, outputs = rows
    config = CltTrainingConfig(d_sae=64, k=4, batch_size=64, warmup_steps=5)
    whole, _ = _train(inputs, outputs, config, 20)
    first, _ = _train(inputs, outputs, config, 10)
    first.checkpoint().save(tmp_path / "member")  # the files a group's checkpoint holds
    resumed = CltTrainer(config, sample_inputs=inputs[:2048], sample_outputs=outputs[:2048],
                         resume=TrainingCheckpoint.load(tmp_path / "member"))  # fmt: skip
    assert resumed.step_count == 10 and len(resumed.history) == 10
    # The same batches as the uninterrupted run's last ten: drawn from the generator it used.
    generator = torch.Generator().manual_seed(0)
    for _ in range(10):
        torch.randint(len(inputs), (config.batch_size,), generator=generator)
    for _ in range(10):
        picked = torch.randint(len(inputs), (config.batch_size,), generator=generator)
        resumed.step(inputs[picked], outputs[picked])
    for mine, theirs in zip(resumed.parameters(), whole.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_ce_loss_recovered_replaces_every_mlp_as_a_hand_written_forward(rows):
    weights, batches, inputs, outputs = rows
    config = CltTrainingConfig(d_sae=128, k=8, lr=3e-3, batch_size=128, warmup_steps=10)
    trainer, _ = _train(inputs, outputs, config, 100)
    clt = trainer.finish(inputs[:2048]).sae
    result = ce_loss_recovered_all_mlps(weights.model, batches[:6], clt)
    # By hand: GPT-2's blocks with each MLP output replaced by the CLT's prediction from the MLP
    # inputs of the replaced run (forward hooks on the modules themselves).
    model = weights.model
    blocks = model.transformer.h
    features, handles = [], []
    for layer, block in enumerate(blocks):

        def take(module, args, output, layer=layer):
            features.append(clt.encode(layer, output))

        def replace(module, args, output, layer=layer):
            return clt.reconstruct(layer, features, args[0])

        # ln_2's output is the MLP's input; the MLP's output is replaced.
        handles.append(block.ln_2.register_forward_hook(take))
        handles.append(block.mlp.register_forward_hook(replace))
    total, count = 0.0, 0
    try:
        with torch.no_grad():
            for ids in batches[:6]:
                features.clear()
                logits = model(ids).logits
                total += float(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum"))
                count += ids.shape[1] - 1
    finally:
        for handle in handles:
            handle.remove()
    assert result["replaced"] == pytest.approx(total / count, rel=1e-5)
    # (A random model barely needs its MLPs: the bench measures recovery on the trained demo.)
    assert result["zero"] != result["clean"] and result["recovered"] == pytest.approx(
        (result["zero"] - result["replaced"]) / (result["zero"] - result["clean"])
    )
