"""The models page and the model detail page, as the server renders them (Django test client)."""

import re

import pytest
from django.test import Client

from activations.models import ActivationCache, ExtractionJob
from activations.services import dataset_create_from_texts
from models_app.models import LanguageModel
from models_app.services import model_register

pytestmark = pytest.mark.django_db


def browser_for(user) -> Client:
    browser = Client()
    browser.force_login(user)
    return browser


@pytest.fixture
def tiny_model(tiny_gpt2_folder) -> LanguageModel:
    return model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny-gpt2", owner=None)


def card_of(page: str, model_id: str) -> str:
    match = re.search(
        rf'<article class="card model-card" data-model-id="{model_id}".*?</article>', page, re.S
    )
    assert match, f"no card for {model_id}"
    return match.group(0)


# --- the models page -----------------------------------------------------------------------------------


def test_each_model_is_a_card_with_its_numbers_status_and_actions(writer, tiny_model):
    page = browser_for(writer).get("/").content.decode()
    card = card_of(page, tiny_model.id)
    assert f'href="/models/{tiny_model.id}/"' in card and ">tiny-gpt2<" in card
    assert 'class="badge status-pending" data-field="status">not loaded<' in card
    assert 'data-family="gpt2"' in card and ">gpt2<" in card
    assert 'data-field="parameters" title="173824">173.8K<' in card
    assert 'data-field="num_layers">2<' in card
    assert 'data-field="quantization">none<' in card
    assert "≈ 679.0 KiB" in card  # the estimate for float32, since it is not loaded
    assert 'data-action="load"' in card and 'data-action="delete"' in card
    # the Add dialog offers exactly the quantizations the API accepts
    assert 'id="add-model-open"' in page and 'id="add-model-dialog"' in page
    options = re.findall(
        r'<option value="(\w+)">', page.split('id="add-quantization"')[1].split("</select>")[0]
    )
    assert options == LanguageModel.Quantization.values
    assert "No models yet" in page and 'id="models-empty" hidden' in page


def test_no_models_yet_explains_how_to_add_one(writer):
    page = browser_for(writer).get("/").content.decode()
    empty = page.split('id="models-empty"')[1].split("</div>")[0]
    assert "hidden" not in empty.split(">")[0]
    assert "No models yet" in empty and "Add model" in empty
    assert "manage.py add_model" in empty and "bootstrap_demo" in empty


def test_query_parameters_preset_the_filters(writer, tiny_model):
    page = browser_for(writer).get("/?status=ready&family=gpt2").content.decode()
    assert '<option value="ready" selected>' in page and '<option value="gpt2" selected>' in page
    assert card_of(page, tiny_model.id).split(">")[0].endswith(" hidden")  # pending, not ready
    assert 'id="models-no-match"' in page and 'id="models-no-match" hidden' not in page
    assert "0 of 1 models" in page
    shown = browser_for(writer).get("/?q=TINY").content.decode()
    assert not card_of(shown, tiny_model.id).split(">")[0].endswith(" hidden")


def test_a_reader_sees_the_models_but_cannot_add_or_act(reader, tiny_model):
    page = browser_for(reader).get("/").content.decode()
    assert tiny_model.id in page
    assert 'id="add-model-open"' not in page and 'id="add-model-dialog"' not in page
    assert "data-action=" not in page


# --- the model detail page -------------------------------------------------------------------------------


def test_detail_shows_configuration_memory_hook_points_caches_and_jobs(writer, tiny_model):
    dataset = dataset_create_from_texts(
        name="corpus", texts=["one two", "three four"], owner=writer, source="upload"
    )
    cache = ActivationCache.objects.create(
        key_hash="k" * 64, key={}, model=tiny_model, dataset=dataset, hooks=["blocks.1.hook_resid_post"],
        max_length=128, dtype="float32", status="completed", num_samples=2, num_tokens=9,
        file_size_bytes=4096, owner=writer,
    )  # fmt: skip
    job = ExtractionJob.objects.create(
        model=tiny_model, dataset=dataset, cache=cache, hooks=cache.hooks, status="completed",
        samples_processed=2, total_samples=2, progress=100, owner=writer,
    )  # fmt: skip
    page = browser_for(writer).get(f"/models/{tiny_model.id}/").content.decode()

    config = page.split('id="config-table"')[1].split("</table>")[0]
    for label, value, key in [
        ("Hidden size", "64", "n_embd"),
        ("Layers", "2", "n_layer"),
        ("Attention heads", "4", "n_head"),
        ("Vocabulary", "1,024", "vocab_size"),
        ("Context length", "128", "n_positions"),
        ("Activation", "gelu_new", "activation_function"),
    ]:
        assert f'<th scope="row">{label}</th><td>{value}</td><td class="key">{key}</td>' in config
    assert "&quot;n_embd&quot;: 64" in page.split('id="config-json"')[1]  # the raw JSON, escaped

    memory = page.split('id="memory-table"')[1].split("</table>")[0]
    assert re.search(r'<tr class="current" data-option="none">', memory)
    assert 'data-option="fp16"' in memory and "339.5 KiB" in memory

    hooks = page.split('id="hook-points"')[1].split("</section>")[0]
    assert (
        "<span>Embedding</span>" in hooks
        and "<span>Layer 1</span>" in hooks
        and "<span>Final</span>" in hooks
    )
    assert '<li title="blocks.1.mlp.hook_post">mlp.hook_post<small>256</small></li>' in hooks

    caches = page.split('id="cache-table"')[1].split("</table>")[0]
    assert f'href="/activations/{cache.id}/"' in caches and 'href="/datasets/' in caches
    jobs = page.split('id="job-table"')[1].split("</table>")[0]
    assert f'data-job-id="{job.id}"' in jobs and "2 / 2" in jobs


def test_new_cache_and_job_rows_come_from_the_templates_of_the_page(writer, reader, tiny_model):
    dataset = dataset_create_from_texts(name="corpus", texts=["one two"], owner=writer, source="upload")
    cache = ActivationCache.objects.create(
        key_hash="r" * 64, key={}, model=tiny_model, dataset=dataset,
        hooks=["hook_embed", "blocks.0.hook_resid_post"], max_length=128, dtype="float32",
        status="completed", num_samples=1, num_tokens=2, file_size_bytes=2048, owner=writer,
    )  # fmt: skip
    job = ExtractionJob.objects.create(
        model=tiny_model, dataset=dataset, cache=cache, hooks=cache.hooks, status="failed",
        samples_processed=0, total_samples=1, owner=writer, error_code="OOPS", error_message="<it broke>",
    )  # fmt: skip
    browser = browser_for(writer)
    page = browser.get(f"/models/{tiny_model.id}/").content.decode()

    def rows(markup: str, attribute: str) -> list[str]:
        return re.findall(rf"<tr {attribute}=.*?</tr>", markup, flags=re.S)

    cache_row = browser.get(f"/models/{tiny_model.id}/", {"fragment": "cache-row", "cache": cache.id})
    assert cache_row.status_code == 200
    assert rows(cache_row.content.decode(), "data-cache-id") == rows(page, "data-cache-id")
    assert f'href="/datasets/{dataset.id}/">corpus</a>' in cache_row.content.decode()
    assert '<td title="hook_embed, blocks.0.hook_resid_post">2</td>' in cache_row.content.decode()
    job_row = browser.get(f"/models/{tiny_model.id}/", {"fragment": "job-row", "job": job.id})
    assert job_row.status_code == 200
    assert rows(job_row.content.decode(), "data-job-id") == rows(page, "data-job-id")
    assert "OOPS: &lt;it broke&gt;" in job_row.content.decode()

    # Only this model's rows, and only what the user may see.
    other = LanguageModel.objects.create(
        name="other", source="local", identifier="/elsewhere", model_type="gpt2"
    )
    for user, model, fragment in [
        (writer, other, {"fragment": "cache-row", "cache": cache.id}),
        (writer, other, {"fragment": "job-row", "job": job.id}),
        (reader, tiny_model, {"fragment": "job-row", "job": job.id}),
    ]:
        assert browser_for(user).get(f"/models/{model.id}/", fragment).status_code == 404


def test_an_unloaded_model_asks_to_be_loaded_before_extracting(writer, tiny_model):
    dataset_create_from_texts(name="corpus", texts=["a b c"], owner=writer, source="upload")
    page = browser_for(writer).get(f"/models/{tiny_model.id}/").content.decode()
    assert 'id="extract-locked">' in page and "Load the model to extract activations." in page
    assert '<form id="extract-form" class="extract-form" novalidate hidden>' in page


def test_a_ready_model_offers_the_extraction_form(writer, tiny_model):
    dataset = dataset_create_from_texts(name="corpus", texts=["a b c"], owner=writer, source="upload")
    LanguageModel.objects.filter(pk=tiny_model.pk).update(status="ready", host_worker="w1")
    page = browser_for(writer).get(f"/models/{tiny_model.id}/").content.decode()
    assert '<form id="extract-form" class="extract-form" novalidate>' in page
    assert 'id="extract-locked" hidden' in page
    assert f'<option value="{dataset.id}" data-samples="1">corpus · 1 sample</option>' in page
    assert 'name="hooks" value="blocks.0.hook_resid_post"' in page and 'data-pick="hook_resid_post"' in page
    assert 'name="max_length" type="number" min="1" max="131072" step="1" value="128"' in page  # its context
    dtypes = page.split('id="extract-dtype"')[1].split("</select>")[0]
    assert re.findall(r'<option value="(\w+)" data-bytes="(\d)"( selected)?>([^<]*)<', dtypes) == [
        ("float32", "4", " selected", "float32 (the model&#x27;s dtype)"),
        ("bfloat16", "2", "", "bfloat16"),
        ("float16", "2", "", "float16"),
    ]


def test_the_extraction_form_offers_ones_own_datasets_first(writer, tiny_model):
    """Before: it preselected whichever dataset was newest, another user's shared one included."""
    from conftest import make_user

    mine = dataset_create_from_texts(name="mine", texts=["a b c"], owner=writer, source="upload")
    other = make_user("olga-other", "model:write")
    theirs = dataset_create_from_texts(name="theirs", texts=["d e f"], owner=other, source="upload")
    theirs.shared = True
    theirs.save(update_fields=["shared"])  # newer than mine, and visible
    LanguageModel.objects.filter(pk=tiny_model.pk).update(status="ready", host_worker="w1")
    page = browser_for(writer).get(f"/models/{tiny_model.id}/").content.decode()
    listed = re.findall(r'<option value="(ds_\w+)" data-samples', page.split('id="extract-dataset"')[1])
    assert listed[:2] == [mine.id, theirs.id]


def test_a_half_precision_model_offers_its_own_dtype_first(writer, tiny_model):
    dataset_create_from_texts(name="corpus", texts=["a b c"], owner=writer, source="upload")
    LanguageModel.objects.filter(pk=tiny_model.pk).update(status="ready", quantization="bf16")
    page = browser_for(writer).get(f"/models/{tiny_model.id}/").content.decode()
    dtypes = page.split('id="extract-dtype"')[1].split("</select>")[0]
    assert re.findall(r'<option value="(\w+)"[^>]*?( selected)?>', dtypes) == [
        ("bfloat16", " selected"),
        ("float32", ""),
        ("float16", ""),
    ]


def test_without_datasets_the_form_points_to_the_datasets_page(writer, tiny_model):
    LanguageModel.objects.filter(pk=tiny_model.pk).update(status="ready")
    page = browser_for(writer).get(f"/models/{tiny_model.id}/").content.decode()
    assert "No datasets yet" in page and 'href="/datasets/"' in page and 'id="extract-form"' not in page


def test_a_reader_gets_no_extraction_form_and_no_actions(reader, tiny_model):
    LanguageModel.objects.filter(pk=tiny_model.pk).update(status="ready")
    page = browser_for(reader).get(f"/models/{tiny_model.id}/").content.decode()
    assert tiny_model.name in page
    assert 'id="extract-form"' not in page and "data-action=" not in page
    assert "needs the <code>model:write</code> role" in page


def test_an_unknown_model_is_404(writer):
    assert browser_for(writer).get("/models/m_doesnotexist/").status_code == 404
