"""The activation-patching and logit-lens pages (server side): the forms, the quick picks, the
not-loaded notice, the encoder notice, and the model page's links to both."""

import re

import pytest
from django.test import Client

from models_app.models import LanguageModel
from models_app.services import model_register

WORKER = "probe-worker"


def signed_in(user) -> Client:
    browser = Client()
    browser.force_login(user)
    return browser


def tiny_gpt2(folder, *, loaded: bool) -> LanguageModel:
    """The tiny GPT-2, registered (inspected: its hook points are known), ready on a worker or not."""
    model = model_register(source="local", identifier=str(folder), name="probe-gpt2", owner=None)
    if loaded:
        model.status, model.host_worker = LanguageModel.Status.READY, WORKER
        model.save(update_fields=["status", "host_worker"])
    return model


@pytest.mark.django_db
def test_the_patching_page_offers_the_form_and_quick_picks_of_every_block(writer, tiny_gpt2_folder):
    model = tiny_gpt2(tiny_gpt2_folder, loaded=True)
    page = signed_in(writer).get(f"/models/{model.id}/patching/").content.decode()

    assert 'id="patching-form"' in page and f'data-model-id="{model.id}"' in page
    for name in ("clean", "corrupted", "answer", "wrong_answer", "hooks"):
        assert re.search(
            rf'<label for="(patch-[a-z]+)">.*?</label>\s*<[a-z]+ id="\1" name="{name}"', page, re.S
        )
    picks = dict(re.findall(r'<button type="button" data-hooks="([^"]*)">([^<]+)</button>', page))
    assert picks["blocks.0.hook_resid_pre, blocks.1.hook_resid_pre"] == "resid_pre (default)"
    assert "blocks.0.hook_mlp_out, blocks.1.hook_mlp_out" in picks
    assert 'id="patch-heatmap"' in page and "heat-legend" in page and "frontend/patching.js" in page
    assert 'id="model-not-loaded"' not in page and 'id="needs-write"' not in page
    assert not re.search(r'id="patch-submit"[^>]*disabled', page)


@pytest.mark.django_db
def test_the_logit_lens_page_offers_a_prompt_and_the_table(writer, tiny_gpt2_folder):
    model = tiny_gpt2(tiny_gpt2_folder, loaded=True)
    page = signed_in(writer).get(f"/models/{model.id}/logit-lens/").content.decode()

    assert (
        'id="lens-form"' in page
        and '<label class="visually-hidden" for="lens-prompt">' in page
        and 'name="prompt"' in page
    )
    assert 'id="lens-top" name="top" type="number" min="1" max="20"' in page  # the API's range
    assert 'id="lens-table"' in page and "frontend/logit_lens.js" in page
    assert 'id="model-not-loaded"' not in page


@pytest.mark.django_db
@pytest.mark.parametrize("route", ["patching", "logit-lens"])
def test_a_model_that_is_not_loaded_is_named_with_a_link_to_load_it(writer, tiny_gpt2_folder, route):
    model = tiny_gpt2(tiny_gpt2_folder, loaded=False)
    page = signed_in(writer).get(f"/models/{model.id}/{route}/").content.decode()

    notice = re.search(r'<p class="notice warn" role="status" id="model-not-loaded">(.*?)</p>', page, re.S)
    assert notice and "not loaded" in notice.group(1)
    assert f'href="/models/{model.id}/" id="load-model-link"' in notice.group(1)
    assert 'class="probe-form"' in page  # the form stays: the API has the last word (MODEL_NOT_LOADED)


@pytest.mark.django_db
@pytest.mark.parametrize("route", ["patching", "logit-lens"])
def test_a_reader_sees_the_page_with_the_button_switched_off(reader, tiny_gpt2_folder, route):
    model = tiny_gpt2(tiny_gpt2_folder, loaded=True)
    page = signed_in(reader).get(f"/models/{model.id}/{route}/").content.decode()
    assert 'id="needs-write"' in page
    assert re.search(r'id="(patch|lens)-submit"[^>]*disabled', page)


@pytest.mark.django_db
def test_an_encoder_gets_no_probe_form_and_no_links(writer, tiny_gpt2_folder):
    encoder = LanguageModel.objects.create(
        name="tiny-bert", source="local", identifier=f"{tiny_gpt2_folder}/bert", model_type="bert",
        status=LanguageModel.Status.READY, host_worker=WORKER, num_layers=2,
    )  # fmt: skip
    browser = signed_in(writer)
    page = browser.get(f"/models/{encoder.id}/patching/").content.decode()
    assert 'id="not-causal"' in page and 'id="patching-form"' not in page and "patching.js" not in page
    page = browser.get(f"/models/{encoder.id}/logit-lens/").content.decode()
    assert 'id="not-causal"' in page and 'id="lens-form"' not in page

    detail = browser.get(f"/models/{encoder.id}/").content.decode()
    assert "/patching/" not in detail and "/logit-lens/" not in detail


@pytest.mark.django_db
def test_the_model_page_links_a_causal_lm_to_both_pages(writer, tiny_gpt2_folder):
    model = tiny_gpt2(tiny_gpt2_folder, loaded=False)
    detail = signed_in(writer).get(f"/models/{model.id}/").content.decode()
    assert f'href="/models/{model.id}/patching/" id="patching-link"' in detail
    assert f'href="/models/{model.id}/logit-lens/" id="logit-lens-link"' in detail


@pytest.mark.django_db
def test_an_unknown_model_is_a_404_page(writer):
    assert signed_in(writer).get("/models/m_nothing/patching/").status_code == 404
