"""The hook runtime on real tiny models: a visitor can read, and can replace a value mid-pass.

Replacement is what interventions (steering, ablation) build on, so it is checked against
references computed without the runtime: the model's own final norm applied by hand, and a
replacement of a block's input against the same replacement of the previous block's output.
"""

import pytest
import torch

from engine.hooks import hook_sites
from engine.runtime import HookRuntime, grad_free_mode, pad_token_id, smallest_runner

ATOL = 1e-5


def _ids(model, length=9):
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, model.config.vocab_size, (2, length), generator=generator)


def _hook_count(model) -> int:
    """The runtime's hooks on the model (transformers adds hooks of its own, left alone here)."""
    hooks = [
        hook
        for module in model.modules()
        for hook in (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
    ]
    return sum(getattr(hook, "__module__", None) == "engine.runtime" for hook in hooks)


def _run(model, names, visit, ids):
    sites = hook_sites(model, names)
    runtime = HookRuntime(model, sites, visit, purpose="read")
    runtime.begin_pass(*ids.shape)
    try:
        with grad_free_mode(model)(), runtime.attached():
            assert _hook_count(model) == len(sites)
            output = runtime.run(model, input_ids=ids, output_hidden_states=True)
    finally:
        assert _hook_count(model) == 0
    return runtime, output


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_an_edited_output_flows_into_the_rest_of_the_pass(family, load_tiny):
    model = load_tiny(family).model
    last = model.config.num_hidden_layers - 1
    ids = _ids(model)
    shift = torch.linspace(-1, 1, model.config.hidden_size)
    seen = {}

    def visit(name, tensor):
        seen[name] = tensor.clone()
        if name == f"blocks.{last}.hook_resid_post":
            return tensor + shift
        return None

    _, output = _run(model, [f"blocks.{last}.hook_resid_post", "ln_final.hook_normalized"], visit, ids)
    final_norm = model.get_submodule(
        hook_sites(model, ["ln_final.hook_normalized"])["ln_final.hook_normalized"].module_path
    )
    with torch.no_grad():
        expected = final_norm(seen[f"blocks.{last}.hook_resid_post"] + shift)
    torch.testing.assert_close(seen["ln_final.hook_normalized"], expected, atol=ATOL, rtol=0)
    # The model's own output (its last hidden state is the final norm's output) follows too.
    torch.testing.assert_close(output.hidden_states[-1], expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_editing_a_blocks_input_equals_editing_the_previous_blocks_output(family, load_tiny):
    model = load_tiny(family).model
    ids = _ids(model)
    shift = torch.linspace(1, -1, model.config.hidden_size)

    def edit(target):
        def visit(name, tensor):
            return tensor + shift if name == target else None

        return visit

    _, through_input = _run(model, ["blocks.1.hook_resid_pre"], edit("blocks.1.hook_resid_pre"), ids)
    _, through_output = _run(model, ["blocks.0.hook_resid_post"], edit("blocks.0.hook_resid_post"), ids)
    _, untouched = _run(model, ["blocks.0.hook_resid_post"], lambda name, tensor: None, ids)
    torch.testing.assert_close(through_input.logits, through_output.logits, atol=ATOL, rtol=0)
    assert not torch.allclose(through_input.logits, untouched.logits, atol=1e-3)


def test_a_replacement_of_another_shape_is_refused_and_no_hook_stays(load_tiny):
    from engine.hooks import HookError

    model = load_tiny("gpt2").model
    ids = _ids(model)
    with pytest.raises(HookError) as refused:  # _run checks that no hook stays
        _run(model, ["blocks.0.hook_resid_post"], lambda name, tensor: tensor[:, :1], ids)
    assert refused.value.code == "INVALID_HOOK"


def test_a_stopped_pass_visits_every_hook_once_and_skips_the_rest(load_tiny):
    model = load_tiny("gpt2").model
    ids = _ids(model)
    sites = hook_sites(model, ["blocks.0.hook_resid_post", "hook_embed"])
    visits = []
    runtime = HookRuntime(model, sites, lambda name, tensor: visits.append(name), purpose="read")
    runner = smallest_runner(model, sites.values())
    assert runner is not model  # the LM head is not needed for block outputs
    last_block = model.get_submodule(sites["blocks.0.hook_resid_post"].module_path.rsplit(".", 1)[0] + ".1")
    later_calls = []
    handle = last_block.register_forward_hook(lambda *args: later_calls.append(1))
    try:
        runtime.begin_pass(*ids.shape, stop_when_complete=True)
        with grad_free_mode(model)(), runtime.attached():
            assert runtime.run(runner, input_ids=ids) is None
    finally:
        handle.remove()
    assert sorted(visits) == ["blocks.0.hook_resid_post", "hook_embed"]
    assert runtime.missing() == []
    assert later_calls == []


def test_the_pad_id_prefers_an_override_then_the_models_own(load_tiny):
    model = load_tiny("gpt2").model
    assert pad_token_id(model, 7) == 7
    expected = (
        model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id
    )
    assert pad_token_id(model) == (expected if expected is not None else 0)
