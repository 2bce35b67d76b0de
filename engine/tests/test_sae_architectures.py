"""SAE architectures and member kinds as registered types: the registry is torch-free, each
architecture's per-feature values agree with its encoder, a new architecture is one class, and
the SAELens names of every member kind read back as what was written."""

import subprocess
import sys

import pytest
import torch

from engine.hooks import layer_of_transcoder_hooks, transcoder_hooks
from engine.sae import SaeShape, SparseAutoencoder, TrainingConfig
from engine.sae.training import SaeTrainer
from engine.sae_architectures import (
    ARCHITECTURES,
    MEMBER_KINDS,
    REGISTRY,
    architecture_named,
    register_architecture,
    saelens_form,
    saelens_member,
)
from engine.sae_architectures.base import Architecture

D_IN, D_SAE = 8, 24


def _random_sae(architecture: str) -> SparseAutoencoder:
    kind = architecture_named(architecture)
    sae = SparseAutoencoder(SaeShape(architecture, D_IN, D_SAE, 5 if kind.k_sparse else None))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in sae.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
        sae.threshold.copy_(torch.rand(D_SAE, generator=generator))
    return sae


def test_the_registry_imports_without_torch():
    code = "import sys, engine.sae_architectures, engine.budgets, engine.inspection.sae_folders; "
    code += "print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_architectures_are_listed_default_first_and_unknown_names_refused():
    assert ARCHITECTURES == ("topk", "batchtopk", "matryoshka_batchtopk", "jumprelu", "standard")
    with pytest.raises(ValueError, match="architecture must be one of topk, batchtopk"):
        architecture_named("gated")
    with pytest.raises(ValueError, match="architecture must be one of"):
        SaeShape("gated", D_IN, D_SAE)
    with pytest.raises(ValueError, match="topk needs 0 < k <= d_sae"):
        SaeShape("topk", D_IN, D_SAE, k=D_SAE + 1)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_feature_values_are_the_encodings_of_those_features(architecture):
    sae = _random_sae(architecture)
    x = torch.randn(7, D_IN, generator=torch.Generator().manual_seed(4))
    features = (0, 5, 17, 23)
    values = sae.kind.feature_values(sae, x, features)
    torch.testing.assert_close(values, sae.encode(x)[:, list(features)], rtol=1e-5, atol=1e-5)


def test_every_member_kind_of_every_saved_form_reads_back_as_itself():
    forms = [form for name in ARCHITECTURES if (form := saelens_form(name)) is not None]
    assert [form.name for form in forms] == ["topk", "jumprelu", "standard"]
    names = {}
    for kind in MEMBER_KINDS.values():
        for form in forms:
            name = kind.saelens_name(form)
            names[(kind.name, form.name)] = name
            found = saelens_member(name, has_d_out=kind.transcoder, has_skip=kind.skip)
            assert found == (kind, form)
    assert names[("skip_transcoder", "jumprelu")] == "jumprelu_skip_transcoder"
    assert names[("transcoder", "standard")] == "transcoder"
    assert names[("transcoder", "topk")] == "topk"  # SAELens has no TopK transcoder
    assert saelens_member("gated", has_d_out=False, has_skip=False) is None


def test_the_transcoder_hook_pair_is_spelt_once():
    assert transcoder_hooks(2) == ("blocks.2.ln2.hook_normalized", "blocks.2.hook_mlp_out")
    assert layer_of_transcoder_hooks(*transcoder_hooks(11)) == 11
    assert layer_of_transcoder_hooks("blocks.2.ln2.hook_normalized", "blocks.3.hook_mlp_out") is None
    assert layer_of_transcoder_hooks("blocks.2.hook_resid_pre", "blocks.2.hook_mlp_out") is None
    assert layer_of_transcoder_hooks(None, None) is None


@pytest.fixture
def leaky_architecture():
    """A new architecture, registered for one test: one class, nothing else."""

    @register_architecture
    class LeakyReLU(Architecture):
        name = "leaky_relu_test"
        label = "Leaky ReLU (test)"
        penalty = "l1_coefficient"
        default_penalty = 1.0
        saved_as = "standard"

        def activate(self, sae, hidden_pre):
            return hidden_pre.relu() + 0.01 * hidden_pre.clamp(max=0)

        def column_activations(self, sae, hidden_pre, columns):
            return self.activate(sae, hidden_pre)

    yield REGISTRY[LeakyReLU.name]
    del REGISTRY[LeakyReLU.name]


def test_a_new_architecture_is_one_class_that_trains_and_encodes(leaky_architecture):
    x = torch.randn(256, D_IN, generator=torch.Generator().manual_seed(5))
    config = TrainingConfig(
        architecture=leaky_architecture.name, d_sae=D_SAE, batch_size=64, total_tokens=256, warmup_steps=1
    )
    trainer = SaeTrainer(config, d_in=D_IN, sample=x)
    metrics = [trainer.step(x[start : start + 64]) for start in range(0, 256, 64)]
    assert all(torch.isfinite(torch.tensor(step.mse)) for step in metrics)
    sae = trainer.finish(x).sae
    values = sae.kind.feature_values(sae, x, (1, 2))
    torch.testing.assert_close(values, sae.encode(x)[:, [1, 2]], rtol=1e-5, atol=1e-5)
