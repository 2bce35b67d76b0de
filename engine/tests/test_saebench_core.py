"""SAEBench's core metrics on our side (sae-bench itself is the reference in test_saebench.py, in the
benchmark environment): the stacked pass gives exactly what three passes give, in every family; the
clean CE loss is transformers' own loss and L0 is the features of transformers' own hidden states;
a transcoder is measured against the output it predicts; the token batches are cut as SAELens cuts
them; a cancel stops between batches."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.sae.evaluation import EvaluationCancelled, EvaluationError
from engine.saebench.core import context_batches, core_metrics
from engine.saebench.results import CoreConfig, core_feature_details
from engine.testing.tiny_models import build_tiny_model, local_corpus
from engine.testing.tiny_saes import random_sae, random_transcoders

CONFIG = CoreConfig(
    context_size=32, batch_size_prompts=4, n_eval_reconstruction_batches=2, n_eval_sparsity_variance_batches=2
)
HOOK = "blocks.1.hook_resid_post"


def _setup(tmp_path_factory, family):
    folder = build_tiny_model(family, tmp_path_factory.mktemp(family) / family, size="tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batches = context_batches(
        (tokenizer(text, add_special_tokens=False)["input_ids"] for text in local_corpus()),
        context_size=32, batch_size=4, batches=2, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    return model, batches


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3_text"])
def test_the_stacked_pass_equals_three_passes_and_transformers(tmp_path_factory, family):
    model, batches = _setup(tmp_path_factory, family)
    sae = random_sae(model.config.hidden_size, "topk", k=8, seed=3)
    stacked = core_metrics(model, sae, batches, hook_name=HOOK, config=CONFIG)
    three = core_metrics(model, sae, batches, hook_name=HOOK, config=CONFIG, stack=False)
    assert stacked.stacked and not three.stacked
    assert json.dumps(stacked.metrics) == json.dumps(three.metrics)  # bit for bit (NaN too)
    with torch.no_grad():
        losses = [float(model(input_ids=batch, labels=batch).loss) for batch in batches]
        hidden = [model(input_ids=batch, output_hidden_states=True).hidden_states[2] for batch in batches]
        l0 = torch.cat([(sae.encode(states) != 0).sum(-1).flatten().float() for states in hidden]).mean()
    performance = stacked.metrics["model_performance_preservation"]
    assert performance["ce_loss_without_sae"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert stacked.metrics["sparsity"]["l0"] == pytest.approx(float(l0), rel=1e-6) == 8.0
    assert len(core_feature_details(stacked.feature_metrics)) == sae.shape.d_sae


def test_a_transcoder_is_measured_against_the_output_it_predicts(tmp_path_factory):
    model, batches = _setup(tmp_path_factory, "gpt2")
    transcoder = random_transcoders(model, "topk", k=8, seed=4)[1]
    result = core_metrics(
        model, transcoder, batches, hook_name="blocks.1.hook_mlp_out",
        input_hook="blocks.1.ln2.hook_normalized", config=CONFIG,
    )  # fmt: skip
    assert not result.stacked  # its output is no residual-stream point: three passes
    assert result.metrics["sparsity"]["l0"] > 0
    assert result.metrics["model_performance_preservation"]["ce_loss_with_sae"] > 0


def test_batches_begin_with_bos_and_continue_documents():
    batches = context_batches(
        [[1, 2, 3], [4, 5, 6, 7, 8]], context_size=4, batch_size=2, batches=1, bos_token_id=0
    )
    assert batches[0].tolist() == [[0, 1, 2, 3], [0, 4, 5, 6]]
    unbounded = context_batches(
        [list(range(1, 10))], context_size=3, batch_size=1, batches=9, bos_token_id=None
    )
    assert [batch.tolist() for batch in unbounded] == [[[1, 2, 3]], [[4, 5, 6]], [[7, 8, 9]]]
    with pytest.raises(EvaluationError) as refused:
        context_batches([[1, 2]], context_size=4, batch_size=2, batches=1, bos_token_id=0)
    assert refused.value.code == "NOT_ENOUGH_TOKENS"


def test_a_cancel_stops_between_batches(tmp_path_factory):
    model, batches = _setup(tmp_path_factory, "gpt2")
    sae = random_sae(model.config.hidden_size, "topk", k=8, seed=3)
    asked = []

    def should_cancel():
        asked.append(1)
        return len(asked) > 1

    with pytest.raises(EvaluationCancelled):
        core_metrics(model, sae, batches, hook_name=HOOK, config=CONFIG, should_cancel=should_cancel)
    assert len(asked) == 2


def test_several_saes_share_each_pass_and_score_as_they_would_alone(tmp_path_factory):
    from engine.saebench.core import core_metrics_many

    model, batches = _setup(tmp_path_factory, "llama")
    width = model.config.hidden_size
    saes = [random_sae(width, "topk", k=k, seed=seed) for k, seed in ((4, 3), (8, 4), (16, 5))]
    together = core_metrics_many(model, saes, batches, hook_name=HOOK, config=CONFIG)
    for sae, result in zip(saes, together, strict=True):
        alone = core_metrics(model, sae, batches, hook_name=HOOK, config=CONFIG)
        assert result.stacked and alone.stacked
        assert result.flat() == pytest.approx(alone.flat(), rel=1e-6, nan_ok=True)
        assert result.feature_metrics["feature_density"] == pytest.approx(
            alone.feature_metrics["feature_density"]
        )
    assert [result.metrics["sparsity"]["l0"] for result in together] == [4.0, 8.0, 16.0]
    # three passes a batch (the ablated one once for all SAEs) give the same numbers
    unstacked = core_metrics_many(model, saes, batches, hook_name=HOOK, config=CONFIG, stack=False)
    for result, passes in zip(together, unstacked, strict=True):
        assert not passes.stacked and passes.flat() == pytest.approx(result.flat(), rel=1e-6, nan_ok=True)
    # the clean and ablated runs are the same for all: computed once, the same numbers in each
    assert (
        len(
            {result.metrics["model_performance_preservation"]["ce_loss_with_ablation"] for result in together}
        )
        == 1
    )
