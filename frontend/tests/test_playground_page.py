"""The playground page (server side): ready models only, the empty state, the heatmap fragment."""

import re
from html import unescape

import numpy as np
import pytest
from django.test import Client

from activations.store import ActivationStore
from conftest import make_user
from generation.models import Generation
from generation.services import SamplingRequest, generation_request
from mistudio.access import OPERATOR
from mistudio.workers import run_worker
from models_app.models import LanguageModel
from models_app.services import model_load_request, model_register
from saes.models import SparseAutoencoder

WORKER = "playground-worker"


def signed_in(user) -> Client:
    browser = Client()
    browser.force_login(user)
    return browser


def registered(folder, name: str, status: str) -> LanguageModel:
    """A model row in ``status`` (each its own identifier: the registry allows one row per source)."""
    return LanguageModel.objects.create(
        name=name, source="local", identifier=f"{folder}/{name}", model_type="gpt2", status=status,
        host_worker=WORKER if status == "ready" else "", num_layers=2,
    )  # fmt: skip


@pytest.mark.django_db
def test_the_model_choice_lists_ready_models_only(writer, tiny_gpt2_folder):
    ready = registered(tiny_gpt2_folder, "ready-one", LanguageModel.Status.READY)
    other = registered(tiny_gpt2_folder, "ready-two", LanguageModel.Status.READY)
    for status in ("pending", "loading", "unloaded", "failed"):
        registered(tiny_gpt2_folder, f"{status}-model", status)

    page = signed_in(writer).get(f"/playground/?model={other.id}").content.decode()
    options = re.findall(r'<option value="(m_[^"]+)"', page)
    assert sorted(options) == sorted([ready.id, other.id])
    assert re.search(rf'<option value="{other.id}"[^>]*selected', page)  # ?model= preselects
    assert 'id="generate-form"' in page and "No model is loaded" not in page
    assert 'name="temperature" min="0" max="2"' in page and 'max="2048"' in page  # the API's ranges
    assert "frontend/playground.js" in page


@pytest.mark.django_db
def test_without_a_ready_model_the_page_says_how_to_load_one(writer, tiny_gpt2_folder):
    registered(tiny_gpt2_folder, "still-loading", LanguageModel.Status.LOADING)
    page = signed_in(writer).get("/playground/").content.decode()
    assert "No model is loaded" in page and 'href="/"' in page
    assert 'id="generate-form"' not in page and "playground.js" not in page


@pytest.mark.django_db
def test_a_reader_sees_the_form_with_generate_switched_off(reader, tiny_gpt2_folder):
    registered(tiny_gpt2_folder, "ready-one", LanguageModel.Status.READY)
    page = signed_in(reader).get("/playground/").content.decode()
    assert "needs the <code>model:write</code> role" in page
    assert re.search(r'id="generate-button"[^>]*disabled', page)


def sae_row(model, owner, name: str, *, status: str = "completed", shared: bool = False) -> SparseAutoencoder:
    return SparseAutoencoder.objects.create(
        name=name, model=model, hook_name="blocks.0.hook_resid_post", architecture="standard",
        d_in=64, d_sae=256, status=status, owner=owner, shared=shared,
    )  # fmt: skip


@pytest.mark.django_db
def test_the_steering_panel_offers_visible_completed_saes_preset_from_the_query(writer, tiny_gpt2_folder):
    model = registered(tiny_gpt2_folder, "ready-one", LanguageModel.Status.READY)
    mine = sae_row(model, writer, "mine")
    sae_row(model, writer, "still training", status="training")
    sae_row(model, make_user("olga-other", "model:write"), "not shared")
    browser = signed_in(writer)

    query = {"model": model.id, "sae": mine.id, "feature": "17", "coefficient": "-12.5"}
    page = browser.get("/playground/", query).content.decode()
    panel = re.search(r'id="steer-card".*?</section>', page, re.S).group(0)
    assert re.search(r'<input type="checkbox" id="steer" checked>', panel)  # the preset turns it on
    assert re.search(r'id="steer-fields"\s*>', panel)  # shown
    options = re.findall(r'<option value="(sae_[^"]+)"([^>]*)>', panel)
    assert [value for value, _ in options] == [mine.id]  # completed and visible only
    assert f'data-model="{model.id}"' in options[0][1] and "selected" in options[0][1]
    assert 'id="steer-index" min="0" step="1" value="17"' in panel
    assert 'data-mirror="steer-amount"' in panel and 'id="steer-amount" step="0.5" value="-12.5"' in panel
    assert re.search(r'value="add" checked>', panel) and 'value="clamp_feature" >' in panel
    # The coefficient is in units of the feature's max activation unless the preset says raw.
    assert re.search(r'<option value="max_activation" selected>', panel)
    assert 'id="sweep-coefficients" class="mono" value="0.5, 1, 2, 4, 8"' in panel
    for label in ("SAE", "Feature", "Positions", "Unit"):
        assert re.search(rf'<label for="steer-[a-z]+">{label}</label>', panel)
    assert 'id="steered-pane"' in page and 'id="baseline-pane"' in page

    # Without a preset the panel is off; an unknown or unfinished SAE is named, not dropped silently.
    plain = browser.get("/playground/").content.decode()
    assert '<input type="checkbox" id="steer" >' in plain and re.search(r'id="steer-fields" hidden', plain)
    query = {"sae": "sae_nope", "feature": "x", "coefficient": "inf", "kind": "clamp_feature"}
    unknown = browser.get("/playground/", query).content.decode()
    assert 'id="steer-missing"' in unknown and "<code>sae_nope</code>" in unknown
    assert 'id="steer-index" min="0" step="1" value="0"' in unknown and 'value="4.0"' in unknown
    assert re.search(r'value="clamp_feature" checked>', unknown) and ">Value</label>" in unknown


def test_anonymous_visitors_sign_in_first(client):
    response = client.get("/playground/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def token_spans(markup: str) -> list[tuple[list[str], str, str, float, str]]:
    """(classes, prompt or generated, title, data-value, text) of each token span."""
    spans = re.findall(
        r'<span class="(tok[^"]*)" data-alpha="[0-9.]+" title="([^"]*)" data-value="([^"]+)">(.*?)</span>',
        markup,
        flags=re.S,
    )
    return [
        (classes.split(), "generated" if "generated" in classes.split() else "prompt", unescape(title),
         float(value), unescape(text))
        for classes, title, value, text in spans
    ]  # fmt: skip


@pytest.mark.django_db(transaction=True)
def test_the_heatmap_fragment_shows_one_neuron_over_prompt_and_generated_tokens(writer, tiny_gpt2_folder):
    from django.conf import settings

    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="heat-gpt2", owner=None)
    model_load_request(model_id=model.id, actor=OPERATOR)
    run_worker(name=WORKER, device="cpu", burst=True)
    hook = "blocks.1.mlp.hook_post"
    [row] = generation_request(
        model_id=model.id,
        owner=writer,
        prompts=["The river runs\ndown to the sea"],
        sampling=SamplingRequest(temperature=0, max_tokens=6, ignore_eos=True, max_tokens_explicit=True),
        capture=[hook],
    )
    run_worker(name=WORKER, device="cpu", burst=True)
    row.refresh_from_db()
    assert row.status == Generation.Status.COMPLETED and row.cache_id

    browser = signed_in(writer)
    neuron = 5
    response = browser.get("/playground/", {"heatmap": row.cache_id, "hook": hook, "neuron": neuron})
    assert response.status_code == 200
    html = response.content.decode()
    spans = token_spans(html)
    assert [kind for _, kind, _, _, _ in spans] == ["prompt"] * row.prompt_tokens + ["generated"] * 6
    expected = ActivationStore.open(settings.ACTIVATION_CACHE_DIR / row.cache_id).get(hook)[:, neuron]
    np.testing.assert_allclose([value for _, _, _, value, _ in spans], expected, rtol=1e-6)
    signs = [classes[1] for classes, _, _, _, _ in spans]
    assert "pos" in signs and "neg" in signs
    # The prompt tokens' texts spell the prompt (a newline token shows its mark; the stylesheet breaks
    # the line after it).
    prompt_text = "".join(text for _, kind, _, _, text in spans if kind == "prompt")
    assert prompt_text.replace("↵", "\n") == row.prompt
    assert all("newline" in classes for classes, *_, text in spans if "↵" in text)
    assert all(title.startswith(f"{hook}[{neuron}] = ") for _, _, title, _, _ in spans)  # the exact value
    # One boundary, where the generated tokens begin.
    assert html.count('<span class="boundary"') == 1
    assert len(token_spans(html[: html.index('<span class="boundary"')])) == row.prompt_tokens

    # The activation browser's heatmap of the same cache shows the same tokens with the same text.
    browser_panel = browser.get(
        f"/activations/{row.cache_id}/", {"hook": hook, "neuron": neuron, "fragment": "sample"}
    ).content.decode()
    assert [(kind, text) for _, kind, _, _, text in token_spans(browser_panel)] == [
        (kind, text) for _, kind, _, _, text in spans
    ]

    bad_neuron = browser.get("/playground/", {"heatmap": row.cache_id, "hook": hook, "neuron": 10_000})
    assert bad_neuron.status_code == 400 and "neurons" in bad_neuron.content.decode()
    missing = browser.get("/playground/", {"heatmap": "act_nosuchcache", "hook": hook, "neuron": 0})
    assert missing.status_code == 404 and 'class="notice error"' in missing.content.decode()
