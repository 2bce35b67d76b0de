"""Interventions through the front doors (``mistudio.interventions``), on a real Daphne + worker.

References are transformers forward passes over prompt + completion with a hand-written forward
hook making the same change; the worker's decode loop and hook runtime are not involved.
"""

import concurrent.futures
import json

import openai
import pytest
import torch
from django.conf import settings

from activations.store import ActivationStore
from features.tests.conftest import completed_sae_row, random_sae_module
from mistudio.errors import ApplicationError
from models_app.models import LanguageModel
from models_app.services import model_register
from saes.tests.conftest import HOOK, write_planted_cache

from .test_generate_api import get, post

pytestmark = pytest.mark.django_db(transaction=True)

PROMPT = "The river runs down to the sea, and the"


def vector(width: int, *, seed: int = 0, scale: float = 6.0) -> list[float]:
    return (scale * torch.randn(width, generator=torch.Generator().manual_seed(seed))).tolist()


def hooked_forward(folder, tokens: list[int], change):
    """Logits and the block-0 output of a teacher-forced pass with the block's output changed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    seen = []

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        changed = change(hidden)
        seen.append(changed)
        return (changed, *output[1:]) if isinstance(output, tuple) else changed

    handle = model.transformer.h[0].register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([tokens]), use_cache=False).logits[0]
    finally:
        handle.remove()
    return logits, seen[0][0]


def assert_greedy_under(result, logits):
    prompt_length = len(result["input_token_ids"])
    expected = logits[prompt_length - 1 : -1].argmax(-1).tolist()
    assert result["output_token_ids"] == expected[: len(result["output_token_ids"])]


def test_add_through_the_openai_client_steers_and_captures_the_steered_values(live_stack, tiny_gpt2_folder):
    width = LanguageModel.objects.get(pk=live_stack.models["gpt2"]).hidden_size
    steer = vector(width)
    client = openai.OpenAI(base_url=f"{live_stack.base_url}/v1", api_key=live_stack.token, max_retries=0)
    body = {"interventions": [{"type": "add", "hook": HOOK, "vector": steer, "coefficient": 1.5}]}

    def complete(**extra):
        return client.completions.create(
            model=live_stack.models["gpt2"], prompt=PROMPT, temperature=0, max_tokens=12, **extra
        )

    plain = complete()
    steered = complete(extra_body={"mistudio": {**body, "capture": [HOOK]}})
    assert steered.choices[0].text != plain.choices[0].text

    # The stored capture holds the prompt + completion tokens and the steered residual stream.
    activations = steered.model_extra["activations"]
    store = ActivationStore.open(settings.ACTIVATION_CACHE_DIR / activations["cache_id"])
    tokens = store.tokens()["token_ids"].tolist()
    added = 1.5 * torch.tensor(steer)
    logits, block_output = hooked_forward(tiny_gpt2_folder, tokens, lambda hidden: hidden + added)
    prompt_length = steered.usage.prompt_tokens
    generated = tokens[prompt_length:]
    assert generated == logits[prompt_length - 1 : -1].argmax(-1).tolist()
    torch.testing.assert_close(torch.from_numpy(store.get(HOOK)), block_output, atol=1e-4, rtol=0)


def test_sae_feature_interventions_through_api_generate(live_stack, tiny_gpt2_folder):
    from django.contrib.auth import get_user_model

    model = LanguageModel.objects.get(pk=live_stack.models["gpt2"])
    user = get_user_model().objects.get(username="live-writer")
    sae = completed_sae_row(model, write_planted_cache(model, user, samples=32), user)
    module = random_sae_module().eval()
    feature = 7
    direction = module.W_dec[feature].detach()

    def generate(interventions):
        return post(
            live_stack,
            "generate",
            {
                "model_id": model.id, "prompt": PROMPT, "temperature": 0, "max_tokens": 10,
                "mistudio": {"interventions": interventions},
            },
        )  # fmt: skip

    # add: the feature's decoder direction, its hook taken from the SAE.
    status, result = generate([{"type": "add", "sae": sae.id, "feature": feature, "coefficient": 8.0}])
    assert status == 200, result
    logits, _ = hooked_forward(
        tiny_gpt2_folder, result["input_token_ids"] + result["output_token_ids"], lambda h: h + 8 * direction
    )
    assert_greedy_under(result, logits)

    # clamp_feature, the reconstruction error kept: x + (value - f(x)) W_dec[f].
    def clamped(hidden):
        with torch.no_grad():
            current = module.encode(hidden[0])[:, feature]
        return hidden + ((5.0 - current)[:, None] * direction)[None]

    status, result = generate([{"type": "clamp_feature", "sae": sae.id, "feature": feature, "value": 5.0}])
    assert status == 200, result
    logits, _ = hooked_forward(
        tiny_gpt2_folder, result["input_token_ids"] + result["output_token_ids"], clamped
    )
    assert_greedy_under(result, logits)

    # A feature clamped over the prompt only: the worker resolved the SAE again from its cache.
    status, again = generate(
        [{"type": "clamp_feature", "sae": sae.id, "feature": feature, "value": 5.0, "positions": "prompt"}]
    )
    assert status == 200, again


def analysed(sae, *, feature: int, max_activation: float):
    """A completed analysis row giving ``feature`` its max activation (the steering unit)."""
    from django.utils import timezone

    from features.models import Feature, FeatureAnalysis

    analysis = FeatureAnalysis.objects.create(
        sae=sae, owner=sae.owner, status=FeatureAnalysis.Status.COMPLETED, finished_at=timezone.now()
    )
    Feature.objects.create(
        analysis=analysis, index=feature, density=0.1, max_activation=max_activation, mean_activation=0.1
    )


def test_a_sweep_steers_in_units_of_max_activation_and_measures_each_output(live_stack, tiny_gpt2_folder):
    from django.contrib.auth import get_user_model

    model = LanguageModel.objects.get(pk=live_stack.models["gpt2"])
    user = get_user_model().objects.get(username="live-writer")
    sae = completed_sae_row(model, write_planted_cache(model, user, samples=8), user)
    module = random_sae_module().eval()
    feature = 7
    analysed(sae, feature=feature, max_activation=0.5)
    direction = module.W_dec[feature].detach()

    status, sweep = post(
        live_stack,
        "generate/sweep",
        {
            "model_id": model.id, "prompt": PROMPT, "temperature": 0, "max_tokens": 8,
            "intervention": {"type": "add", "sae": sae.id, "feature": feature}, "coefficients": [4, 16],
        },
    )  # fmt: skip
    assert status == 200, sweep
    assert (sweep["unit"], sweep["unit_scale"]) == ("max_activation", 0.5)
    assert sweep["measure"] == {"sae": sae.id, "feature": feature, "hook": HOOK, "scale": 0.5}
    assert [row["coefficient"] for row in sweep["rows"]] == [0, 4, 16]
    assert [row["raw_coefficient"] for row in sweep["rows"]] == [0, 2, 8]
    assert isinstance(sweep["seed"], int)

    prompt_ids = None
    for row in sweep["rows"]:
        result = get(live_stack, f"generations/{row['request_id']}")
        prompt_ids = result["input_token_ids"]
        tokens = prompt_ids + result["output_token_ids"]
        raw = row["raw_coefficient"]
        # The text is what the model writes with raw x the decoder row added (greedy).
        logits, _ = hooked_forward(tiny_gpt2_folder, tokens, lambda h, raw=raw: h + raw * direction)
        assert_greedy_under(result, logits)
        # Its effect: the feature read by the unsteered model over the output, encoded by the SAE.
        _, hidden = hooked_forward(tiny_gpt2_folder, tokens, lambda h: h)
        with torch.no_grad():
            on_text = module.encode(hidden)[len(prompt_ids) :, feature]
        effect = row["effect"]
        assert effect["activation_mean"] == pytest.approx(float(on_text.mean()), abs=1e-4)
        # In units of the feature's max activation too (what the table shows), said as such.
        assert effect["feature_max"] == 0.5
        assert effect["activation_mean_of_max"] == pytest.approx(float(on_text.mean()) / 0.5, abs=2e-4)
        assert effect["generated_tokens"] == len(result["output_token_ids"])
        if raw == 0:
            assert effect["first_token_kl"] is None
            continue
        base, _ = hooked_forward(tiny_gpt2_folder, prompt_ids, lambda h: h)
        moved, _ = hooked_forward(tiny_gpt2_folder, prompt_ids, lambda h, raw=raw: h + raw * direction)
        base, moved = torch.log_softmax(base[-1], -1), torch.log_softmax(moved[-1], -1)
        kl = float((moved.exp() * (moved - base)).sum())
        assert effect["first_token_kl"] == pytest.approx(kl, rel=1e-3, abs=1e-6)

    # The raw unit takes the number as it is; max_activation without an analysis is refused.
    status, raw = post(
        live_stack,
        "generate/sweep",
        {
            "model_id": model.id, "prompt": PROMPT, "temperature": 0, "max_tokens": 2,
            "intervention": {"type": "add", "sae": sae.id, "feature": 3, "unit": "max_activation"},
        },
    )  # fmt: skip
    assert status == 400, raw
    assert list(raw["error"]["details"]["fields"]) == ["interventions[0].unit"]


def test_steered_and_plain_requests_at_once_each_get_their_own(live_stack):
    width = LanguageModel.objects.get(pk=live_stack.models["llama"]).hidden_size
    steering = [{"type": "add", "hook": "blocks.1.hook_resid_post", "vector": vector(width, seed=3)}]
    prompts = [PROMPT, "A queue is a list of items"]

    def generate(prompt, interventions):
        body = {
            "model_id": live_stack.models["llama"], "prompt": prompt, "temperature": 0, "max_tokens": 16,
            "ignore_eos": True, "mistudio": {"interventions": interventions},
        }  # fmt: skip
        status, result = post(live_stack, "generate", body)
        assert status == 200, result
        return result["output_token_ids"]

    alone = {(prompt, bool(items)): generate(prompt, items) for prompt in prompts for items in ([], steering)}
    assert alone[prompts[0], True] != alone[prompts[0], False]
    cases = [(prompt, items) for prompt in prompts for items in ([], steering)] * 2
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        together = list(pool.map(lambda case: generate(*case), cases))
    for (prompt, items), tokens in zip(cases, together, strict=True):
        assert tokens == alone[prompt, bool(items)]


# --- Refused before anything is queued (in process, no worker) ----------------------------------


@pytest.mark.parametrize(
    ("intervention", "field"),
    [
        ({"type": "add", "hook": HOOK, "vector": [1.0] * 63}, "vector"),
        ({"type": "add", "hook": HOOK, "vector": [1.0] * 63 + ["x"]}, "vector"),
        ({"type": "add", "hook": HOOK, "vector": [1.0] * 64, "coefficient": "big"}, "coefficient"),
        ({"type": "add", "hook": "blocks.9.hook_resid_post", "vector": [1.0] * 64}, "hook"),
        ({"type": "add", "hook": HOOK}, "vector"),
        ({"type": "scale", "hook": HOOK}, "type"),
        ({"type": "ablate", "hook": HOOK, "neurons": [64]}, "neurons"),
        ({"type": "ablate", "hook": HOOK}, "neurons"),
        ({"type": "replace", "hook": HOOK, "vector": [0.0] * 64, "positions": [-1]}, "positions"),
        ({"type": "replace", "hook": HOOK, "vector": [0.0] * 64, "positions": "middle"}, "positions"),
        ({"type": "clamp_feature", "hook": HOOK, "value": 1.0}, "sae"),
        ({"type": "add", "hook": HOOK, "vector": [1.0] * 64, "colour": "red"}, "colour"),
    ],
)
def test_bad_interventions_are_a_400_naming_them(client, writer, tiny_gpt2_folder, intervention, field):
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=writer)
    good = {"type": "add", "hook": HOOK, "vector": [0.5] * 64}
    response = client.post(
        "/api/generate",
        json.dumps(
            {"model_id": model.id, "prompt": "x", "mistudio": {"interventions": [good, intervention]}}
        ),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Token {writer.auth_token.key}",
    )
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "INVALID_INTERVENTION"
    assert error["message"].startswith("Intervention 1:")
    assert error["details"]["intervention"] == 1
    assert list(error["details"]["fields"]) == [f"interventions[1].{field}"]


def test_an_sae_the_user_cannot_see_is_a_404(client, writer, reader, tiny_gpt2_folder):
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=writer)
    sae = completed_sae_row(model, write_planted_cache(model, reader, samples=8), reader)  # private
    clamp = {"type": "clamp_feature", "sae": sae.id, "feature": 1, "value": 2}
    body = {"model_id": model.id, "prompt": "x", "mistudio": {"interventions": [clamp]}}
    response = client.post(
        "/api/generate",
        json.dumps(body),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Token {writer.auth_token.key}",
    )
    assert response.status_code == 404, response.content
    assert response.json()["error"]["code"] == "SAE_NOT_FOUND"


def test_mean_ablation_takes_its_means_from_a_cache(writer, tiny_gpt2_folder):
    from activations.store import ActivationStore
    from generation.interventions import interventions_request, resolved_interventions
    from generation.services import hook_widths

    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=writer)
    cache = write_planted_cache(model, writer, samples=16)
    sae = completed_sae_row(model, cache, writer)
    raw = [
        {"type": "ablate", "hook": HOOK, "neurons": [3, 5], "mean_from": cache.id},
        {"type": "ablate", "sae": sae.id, "features": [7], "mean_from": cache.id},
    ]
    spec = interventions_request(raw, widths=hook_widths(model, raw), user=writer)
    neurons, features = resolved_interventions(spec)

    rows = torch.from_numpy(ActivationStore.open(cache.directory).get(HOOK)).float()
    torch.testing.assert_close(neurons.means, rows.mean(dim=0), atol=1e-5, rtol=0)
    with torch.no_grad():
        encoded = random_sae_module().encode(rows).mean(dim=0)
    torch.testing.assert_close(features.means, encoded, atol=1e-5, rtol=0)

    bad = [{"type": "ablate", "hook": "blocks.1.hook_resid_post", "neurons": [1], "mean_from": cache.id}]
    with pytest.raises(ApplicationError) as raised:
        interventions_request(bad, widths=hook_widths(model, bad), user=writer)
    assert raised.value.code == "INVALID_INTERVENTION" and "mean_from" in str(raised.value.details)
