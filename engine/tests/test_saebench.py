"""Our SAEBench core metrics against sae-bench 0.6.0 itself: the same SAE (through its SAELens
folder), the same model (TransformerLens there, transformers here), the same token batches.

``sae-bench`` lives in the benchmark environment (bench/requirements-saebench.txt, with
``--no-deps``), so this module skips in ``make test``; .ci/run runs it in ``.venv-bench``.
"""

import sys
from pathlib import Path

import pytest

pytest.importorskip("sae_bench", reason="sae-bench is in .venv-bench only; .ci/run runs this module there")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import peers
import sae_lens
import torch
from sae_bench.evals.core import main as saebench_core
from sae_bench.evals.core.eval_config import CoreEvalConfig
from sae_bench.evals.core.eval_output import CoreEvalOutput
from sae_bench.sae_bench_utils import general_utils
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.sae.formats import save_saelens
from engine.saebench.core import CoreConfig, context_batches, core_metrics
from engine.saebench.results import (
    core_eval_config,
    core_feature_details,
    saebench_results_json,
)
from engine.testing.corpus import first_word_classes
from engine.testing.tiny_models import build_tiny_model, local_corpus
from engine.testing.tiny_saes import random_sae

RELATIVE = 1e-5
HOOK = "blocks.1.hook_resid_post"
CONFIG = CoreConfig(
    context_size=32, batch_size_prompts=4, n_eval_reconstruction_batches=3, n_eval_sparsity_variance_batches=2
)


class SameBatches:
    """What sae-bench asks of SAELens' ActivationsStore, serving our batches in order."""

    def __init__(self, batches):
        self.batches = batches
        self.context_size = CONFIG.context_size
        self.store_batch_size_prompts = CONFIG.batch_size_prompts
        self.position = 0

    def get_batch_tokens(self, prompts):
        assert prompts == CONFIG.batch_size_prompts
        batch = self.batches[self.position]
        self.position += 1
        return batch

    def reset_input_dataset(self):
        self.position = 0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = build_tiny_model("gpt2", tmp_path_factory.mktemp("model") / "gpt2", size="tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    theirs = peers.load_transformer_lens(folder)
    texts = local_corpus()
    batches = context_batches(
        (tokenizer(text)["input_ids"] for text in texts),
        context_size=CONFIG.context_size,
        batch_size=CONFIG.batch_size_prompts,
        batches=CONFIG.batches,
        bos_token_id=tokenizer.bos_token_id,
    )
    ignore = {tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id}
    return model, theirs, batches, ignore, tmp_path_factory.mktemp("saes")


def _theirs(folder, transformer_lens_model, batches, ignore, dtype):
    loaded = sae_lens.SAE.load_from_disk(folder).to(dtype=dtype)
    _, sae, _ = general_utils.load_and_format_sae("miStudio", loaded, "cpu")
    config = CoreEvalConfig(
        model_name="tiny-gpt2",
        batch_size_prompts=CONFIG.batch_size_prompts,
        n_eval_reconstruction_batches=CONFIG.n_eval_reconstruction_batches,
        n_eval_sparsity_variance_batches=CONFIG.n_eval_sparsity_variance_batches,
        context_size=CONFIG.context_size,
        compute_kl=True,
        compute_ce_loss=True,
        compute_l2_norms=True,
        compute_sparsity_metrics=True,
        compute_variance_metrics=True,
        compute_featurewise_density_statistics=True,
        compute_featurewise_weight_based_metrics=True,
    )
    metrics, features = saebench_core.run_evals(
        sae, SameBatches(batches), transformer_lens_model, config, ignore_tokens=ignore
    )
    metrics["misc_metrics"] = saebench_core.calculate_misc_metrics(features)
    return metrics, features, sae


def _assert_close(name, ours, theirs, relative=RELATIVE):
    ours_t, theirs_t = torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
    both_nan = torch.isnan(ours_t) & torch.isnan(theirs_t)
    scale = theirs_t.abs().clamp(min=1e-6)
    difference = ((ours_t - theirs_t).abs() / scale).masked_fill(both_nan, 0)
    assert float(difference.max()) <= relative, f"{name}: ours {ours!r:.80} theirs {theirs!r:.80}"


# float64 takes float rounding out of the comparison (a score such as ce_loss_score divides two
# small differences of losses, which magnifies it); float32 is what both run by default.
@pytest.mark.parametrize(
    ("architecture", "dtype"),
    [("standard", torch.float32), ("topk", torch.float32), ("standard", torch.float64),
     ("topk", torch.float64), ("jumprelu", torch.float64)],
)  # fmt: skip
def test_core_metrics_equal_saebench(setup, architecture, dtype):
    model, transformer_lens_model, batches, ignore, root = setup
    sae = random_sae(64, architecture, k=8 if architecture == "topk" else None, expansion=4, seed=3)
    if architecture == "jumprelu":
        with torch.no_grad():
            sae.threshold.fill_(0.2)
    folder = save_saelens(sae, root / f"{architecture}-{dtype}", hook_name=HOOK, model_name="tiny-gpt2")
    ours = core_metrics(
        model.to(dtype), sae.to(dtype), batches, hook_name=HOOK, ignore_tokens=ignore, config=CONFIG
    )
    theirs, their_features, their_sae = _theirs(
        folder, transformer_lens_model.to(dtype), batches, ignore, dtype
    )

    assert set(ours.metrics) == set(theirs)
    for category, values in theirs.items():
        assert set(ours.metrics[category]) == set(values), category
        for name, value in values.items():
            _assert_close(f"{category}.{name}", ours.metrics[category][name], value)
    assert 0 < ours.metrics["sparsity"]["l0"] < 256  # neither dead nor dense: the SAE is exercised
    assert ours.metrics["model_performance_preservation"]["ce_loss_with_sae"] != pytest.approx(
        ours.metrics["model_performance_preservation"]["ce_loss_without_sae"]
    )
    assert set(ours.feature_metrics) == set(their_features)
    for name, values in their_features.items():
        _assert_close(name, ours.feature_metrics[name], values)

    exported = saebench_results_json(
        eval_type_id="core",
        eval_config=core_eval_config(CONFIG, model_name="tiny-gpt2", dataset="local corpus"),
        metrics=ours.metrics, details=core_feature_details(ours.feature_metrics), eval_id="e", sae_id="s",
        sae_set="miStudio", sae_cfg=their_sae.cfg.to_dict(),
    )  # fmt: skip
    parsed = CoreEvalOutput(**exported)  # SAEBench's own schema accepts the file
    assert parsed.eval_result_metrics.sparsity.l0 == pytest.approx(ours.metrics["sparsity"]["l0"])
    assert len(parsed.eval_result_details) == sae.shape.d_sae


# --- sparse probing ------------------------------------------------------------------------------


@pytest.mark.parametrize("architecture", ["topk", "jumprelu"])
def test_sparse_probing_equals_saebench(setup, architecture):
    import jaxtyping
    from sae_bench.evals.sparse_probing import probe_training
    from sae_bench.sae_bench_utils import activation_collection, dataset_utils

    # Its shape hints name one dataset size for a class's rows and for a probe's (twice as many)
    # within one call; with this jaxtyping they clash. Hints only: no number changes.
    jaxtyping.config.update("jaxtyping_disable", True)

    from engine.saebench.sparse_probing import sparse_probing, split_by_class

    model, transformer_lens_model, _, _, root = setup
    model, transformer_lens_model = model.float(), transformer_lens_model.to(torch.float32)
    sae = random_sae(64, architecture, k=8 if architecture == "topk" else None, expansion=4, seed=5)
    if architecture == "jumprelu":
        with torch.no_grad():
            sae.threshold.fill_(0.2)
    folder = save_saelens(sae, root / f"probing-{architecture}", hook_name=HOOK, model_name="tiny-gpt2")
    their_sae = sae_lens.SAE.load_from_disk(folder)
    tokenizer = transformer_lens_model.tokenizer
    pairs = first_word_classes()
    # SAEBench's datasets have as many texts in every class (its type hints insist on it)
    smallest = min(sum(label == name for _, label in pairs) for name in {label for _, label in pairs})
    split = split_by_class(pairs, train_fraction=0.7, max_per_class=min(60, smallest), seed=42)
    k_values, context, seed = [1, 2, 5], 48, 42

    (ours,) = sparse_probing(
        model, tokenizer, [sae], split, hook_name=HOOK, k_values=k_values, context_length=context, seed=seed
    )

    def means(texts_by_class, source):
        tokens = dataset_utils.tokenize_data_dictionary(texts_by_class, tokenizer, context, "cpu")
        acts = activation_collection.get_all_llm_activations(
            tokens, transformer_lens_model, 8, 1, HOOK, mask_bos_pad_eos_tokens=True
        )
        if source == "llm":
            return activation_collection.create_meaned_model_activations(acts)
        return activation_collection.get_sae_meaned_activations(acts, their_sae, 125)

    checked = 0
    for source in ("llm", "sae"):
        train, test = means(split.train, source), means(split.test, source)
        for k in k_values:
            torch.manual_seed(seed)
            _, theirs = probe_training.train_probe_on_activations(train, test, select_top_k=k)
            name = f"{source}_top_{k}_test_accuracy"
            for label, accuracy in theirs.items():
                assert abs(ours["per_class"][label][name] - accuracy) <= 1e-6, (name, label)
                checked += 1
            assert abs(ours["metrics"][source][name] - sum(theirs.values()) / len(theirs)) <= 1e-6
    assert checked == 2 * len(k_values) * len(split.train)
    from sae_bench.evals.sparse_probing.eval_output import SparseProbingEvalOutput

    from engine.saebench.results import sparse_probing_output

    config, metrics, details = sparse_probing_output(
        ours["metrics"], {"seed": seed, "context_length": context, "k_values": k_values}, model_name="tiny",
        dataset="words",
    )  # fmt: skip
    exported = saebench_results_json(
        eval_type_id="sparse_probing", eval_config=config, metrics=metrics, details=details, eval_id="e",
        sae_id="s", sae_set="miStudio", sae_cfg=their_sae.cfg.to_dict(),
    )  # fmt: skip
    parsed = SparseProbingEvalOutput(**exported)  # SAEBench's own schema accepts the file
    assert (
        parsed.eval_result_metrics.sae.sae_top_1_test_accuracy
        == ours["metrics"]["sae"]["sae_top_1_test_accuracy"]
    )
    accuracies = [value for group in ours["metrics"].values() for value in group.values()]
    assert max(accuracies) > 0.5 and min(accuracies) < 1.0  # the probes learn something, not everything


# --- feature absorption --------------------------------------------------------------------------


def test_absorption_equals_saebench(setup, tmp_path, monkeypatch):
    """The whole first-letter pipeline, SAEBench's own functions against ours: the words, prompts,
    the model's probe, the k-sparse probes and main features, each word's absorption and the
    means. Both start from the same seeds (SAEBench draws from Python's and torch's global ones)."""
    import random
    import statistics

    from sae_bench.evals.absorption import common, feature_absorption, k_sparse_probing, main
    from sae_bench.evals.absorption.eval_output import AbsorptionEvalOutput
    from sae_bench.evals.absorption.feature_absorption_calculator import FeatureAbsorptionCalculator

    from engine.saebench.absorption import AbsorptionConfig, absorption, alpha_words, word_position
    from engine.saebench.results import absorption_output

    model, transformer_lens_model, _, _, root = setup
    model, transformer_lens_model = model.float(), transformer_lens_model.to(torch.float32)
    tokenizer = transformer_lens_model.tokenizer
    # TransformerLens' own GPT-2 puts the BOS token first, as SAEBench's prompts get it (the
    # module's model is set up without, for comparisons on token ids).
    monkeypatch.setattr(transformer_lens_model.cfg, "default_prepend_bos", True)
    sae = random_sae(64, "topk", k=8, expansion=4, seed=9)
    their_sae = sae_lens.SAE.load_from_disk(
        save_saelens(sae, root / "absorption", hook_name=HOOK, model_name="tiny-gpt2")
    )
    # A random model knows no first letters: every letter with a true positive is counted (F1 > 0).
    config = AbsorptionConfig(min_probe_f1=0.0, min_letters=1, seed=42)
    position = word_position(tokenizer, config.prompt_template)
    (ours,) = absorption(model, tokenizer, [sae], hook_name=HOOK, config=config)

    # The same words: SAEBench walks the vocabulary in its hash map's order, which differs from
    # process to process (so do its splits); ours is the token ids' order.
    words = alpha_words(tokenizer)
    monkeypatch.setattr(common, "get_alpha_tokens", lambda _tokenizer: list(words))
    monkeypatch.setattr(feature_absorption, "get_alpha_tokens", lambda _tokenizer: list(words))
    # Each prompt read alone: this tiny tokenizer has no one-token " Q", so prompts differ in length
    # by a token or two, and SAEBench's right-padded batches would read padding for the shorter.
    unpadded = common.gen_and_save_df_acts_probing
    monkeypatch.setattr(
        common, "gen_and_save_df_acts_probing", lambda **kw: unpadded(**{**kw, "batch_size": 1})
    )
    monkeypatch.setattr(FeatureAbsorptionCalculator, "_validate_prompts_are_same_length", lambda *_: None)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    shared = {"layer": 1, "sae_name": "s", "max_k_value": config.max_k, "device": "cpu", "force": True,
              "prompt_template": config.prompt_template, "prompt_token_pos": position}  # fmt: skip
    metrics = k_sparse_probing.run_k_sparse_probing_experiment(
        model=transformer_lens_model, sae=their_sae, experiment_dir=tmp_path / "k", probes_dir=tmp_path / "p",
        precalc_k_sparse_probe_sae_acts=True, verbose=False, **shared,
    )  # fmt: skip
    raw = feature_absorption.run_feature_absortion_experiment(
        model=transformer_lens_model, sae=their_sae, experiment_dir=tmp_path / "a",
        sparse_probing_experiment_dir=tmp_path / "k", probes_dir=tmp_path / "p", batch_size=1, **shared,
    )  # fmt: skip
    theirs = main._aggregate_results_df(raw)

    letters = {row["first_letter"]: row for row in ours["letters"]}
    for _, row in metrics.iterrows():
        assert abs(letters[row["letter"]]["probe_f1"] - row["f1_probe"]) <= 1e-9, row["letter"]
        assert letters[row["letter"]]["split_features"] == list(row["split_feats"]), row["letter"]
    assert sorted(theirs["letter"]) == sorted(
        name for name, row in letters.items() if row["num_probe_true_positives"]
    )
    for _, row in theirs.iterrows():
        mine = letters[row["letter"]]
        assert mine["num_probe_true_positives"] == row["num_probe_true_positives"]
        assert mine["num_full_absorption"] == row["num_full_absorption"]
        assert abs(mine["mean_absorption_fraction"] - row["mean_absorption_fraction"]) <= 1e-4, row["letter"]
        assert abs(mine["full_absorption_rate"] - row["full_absorption_rate"]) <= 1e-4, row["letter"]
        assert mine["num_split_features"] == row["num_split_feats"]
    counted = [
        row for _, row in theirs.iterrows() if letters[row["letter"]]["probe_f1"] > config.min_probe_f1
    ]
    fractions = [row["mean_absorption_fraction"] for row in counted]
    assert abs(ours["metrics"]["mean"]["mean_absorption_fraction_score"] - statistics.mean(fractions)) <= 1e-4
    assert (
        abs(ours["metrics"]["mean"]["std_dev_absorption_fraction_score"] - statistics.stdev(fractions))
        <= 1e-4
    )
    assert 0 < statistics.mean(fractions) < 1  # some words absorbed, not all: the arithmetic is exercised

    settings, metrics, details = absorption_output(ours, config.to_dict(), model_name="tiny-gpt2")
    exported = saebench_results_json(
        eval_type_id="absorption_first_letter", eval_config=settings, metrics=metrics, details=details,
        eval_id="e", sae_id="s", sae_set="miStudio", sae_cfg=their_sae.cfg.to_dict(),
    )  # fmt: skip
    parsed = AbsorptionEvalOutput(**exported)  # SAEBench's own schema accepts the file
    assert len(parsed.eval_result_details) == len(counted)
