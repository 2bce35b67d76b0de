"""The SAE pages as the server renders them (Django test client): the list with held-out numbers and
live rows, the training form over a real completed cache (prefilled from ``?cache=``, posting
through the same service as the API, errors shown in the form), the import form, one SAE's page
(curves, metrics, "pending" CE loss, hyperparameters, links, actions) and its fragments, and who
may see or change what."""

import re
import xml.etree.ElementTree as ElementTree

import pytest
from django.conf import settings
from django.test import Client

from conftest import make_user
from engine.sae import SaeShape, default_expansion
from engine.sae import SparseAutoencoder as SaeModule
from engine.sae.formats import save_saelens
from mistudio.workers import shared_queue
from models_app.models import LanguageModel
from saes.models import SaeEvaluation, SparseAutoencoder
from saes.tests.conftest import D_IN, HOOK, write_planted_cache

pytestmark = pytest.mark.django_db

HISTORY = [
    {"step": step, "tokens": step * 256, "mse": 1.0 / step, "sparsity_loss": 0.0, "aux_loss": 0.01,
     "l0": 32.0, "explained_variance": 1 - 1.0 / (step + 1), "dead": max(0, 40 - 4 * step), "lr": 3e-4}
    for step in range(1, 13)
]  # fmt: skip
EVALUATION = {
    "tokens": 204, "mse": 0.0123, "explained_variance": 0.9134, "fraction_of_variance_unexplained": 0.0866,
    "l0": 31.5, "dead_features": 7, "dense_features": 2, "dense_threshold": 0.1, "held_out_tokens": 204,
    "ce_loss_recovered": None,
}  # fmt: skip


def signed_in(user) -> Client:
    browser = Client()
    browser.force_login(user)
    return browser


@pytest.fixture
def planted_cache(tiny_model, writer):
    return write_planted_cache(tiny_model, writer, samples=64)


@pytest.fixture
def tiny_model(tiny_gpt2_folder, writer):
    from models_app.services import model_register

    return model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny-gpt2", owner=writer)


def completed_sae(model, cache, owner, **changes) -> SparseAutoencoder:
    values = {
        "name": "resid topk", "model": model, "model_name": "tiny-gpt2", "cache": cache, "hook_name": HOOK,
        "architecture": "topk", "d_in": D_IN, "d_sae": 8 * D_IN, "k": 32, "status": "completed",
        "progress": 100, "step": 12, "total_steps": 12, "tokens_seen": 3072, "total_tokens": 3072,
        "tokens_per_second": 51234.5, "history": HISTORY, "evaluation": EVALUATION,
        "hyperparameters": {"architecture": "topk", "d_sae": 8 * D_IN, "k": 32, "lr": 3e-4,
                            "batch_size": 256, "dead_after_steps": 5},
        "training_time_seconds": 1.5, "owner": owner,
    }  # fmt: skip
    return SparseAutoencoder.objects.create(**{**values, **changes})


def row_of(page: str, sae_id: str) -> str:
    match = re.search(rf'<tr data-sae-id="{sae_id}".*?</tr>', page, re.S)
    assert match, f"no row for {sae_id}"
    return match.group(0)


def svg_points(markup: str) -> list[int]:
    """The number of points each line chart of ``markup`` drew (0 for a "no points yet" chart)."""
    charts = re.findall(r"<svg .*?</svg>", markup, re.S)
    for chart in charts:
        ElementTree.fromstring(chart)  # noqa: S314  (well-formed, whatever went in)
    return [
        int(re.search(r'data-points="(\d+)"', chart)[1]) if "data-points" in chart else 0 for chart in charts
    ]


# --- the list -------------------------------------------------------------------------------------------


def test_the_list_shows_each_sae_with_its_held_out_numbers_and_live_progress(
    writer, tiny_model, planted_cache
):
    done = completed_sae(
        tiny_model, planted_cache, writer, evaluation={**EVALUATION, "ce_loss_recovered": 0.8765}
    )
    running = completed_sae(
        tiny_model, planted_cache, writer, name="running one", status="running", progress=42.5, step=5,
        evaluation={}, eta_seconds=12, architecture="jumprelu", k=None,
    )  # fmt: skip
    failed = completed_sae(
        tiny_model,
        planted_cache,
        writer,
        name="broken",
        status="failed",
        error_code="CACHE_CORRUPT",
        evaluation={},
    )
    page = signed_in(writer).get("/saes/").content.decode()
    assert '<a href="/saes/" aria-current="page">SAEs</a>' in page

    row = row_of(page, done.id)
    assert f'href="/saes/{done.id}/"' in row and ">resid topk<" in row
    assert f'href="/models/{tiny_model.id}/"' in row and ">tiny-gpt2<" in row
    assert f">{HOOK}<" in row and ">topk<" in row and "k=32" in row
    assert f">{D_IN}→{8 * D_IN}<" in row
    assert 'class="badge status-completed"' in row and "data-active" not in row
    assert re.search(r'data-metric="explained_variance">0\.913<', row)
    assert re.search(r'data-metric="l0">31\.5<', row)
    assert re.search(r'data-metric="dead_features">7<', row)
    assert re.search(r'data-metric="ce_loss_recovered">0\.877<', row)

    row = row_of(page, running.id)
    assert "data-active" in row and 'class="badge status-running"' in row
    assert 'data-width="42.5"' in row and "43 %" in row and "ETA 12 s" in row  # progressbar via data-width
    assert re.search(r'data-metric="explained_variance">—<', row)
    assert "CACHE_CORRUPT" in row_of(page, failed.id)
    # the page script that follows the live rows (no inline script: the CSP allows none)
    assert 'src="/static/frontend/saes.js"' in page and "<script>" not in page


def test_a_row_alone_is_the_fragment_the_list_script_fetches(writer, tiny_model, planted_cache):
    sae = completed_sae(tiny_model, planted_cache, writer, status="running", progress=10, evaluation={})
    fragment = signed_in(writer).get(f"/saes/?fragment=row&sae={sae.id}").content.decode()
    assert fragment.strip().startswith("{#") is False and fragment.count("<tr ") == 1
    assert row_of(fragment, sae.id) and "<html" not in fragment
    assert signed_in(writer).get("/saes/?fragment=row&sae=sae_nosuch").status_code == 404


def test_with_no_saes_and_no_caches_the_page_says_what_to_do(writer, reader):
    page = signed_in(writer).get("/saes/").content.decode()
    assert "No SAEs yet" in page and "No completed activation caches yet" in page
    assert 'id="train-form"' not in page and 'id="import-form"' in page
    page = signed_in(reader).get("/saes/").content.decode()
    assert "No SAEs yet" in page and 'id="train-card"' not in page and 'id="import-form"' not in page


# --- training from the form -----------------------------------------------------------------------------


def test_the_form_offers_completed_caches_with_their_hooks_and_the_defaults(
    writer, tiny_model, planted_cache
):
    other = write_planted_cache(tiny_model, writer, samples=32)
    writing = write_planted_cache(tiny_model, writer, samples=32)
    writing.status = "writing"
    writing.save()
    page = signed_in(writer).get(f"/saes/?cache={planted_cache.id}").content.decode()
    form = page[page.index('id="train-form"') : page.index("</form>", page.index('id="train-form"'))]
    caches = re.findall(r'<option value="(act_\w+)" data-tokens="(\d+)"( selected)?>', form)
    assert {cache for cache, _, _ in caches} == {planted_cache.id, other.id}  # completed ones only
    chosen = [(cache, tokens) for cache, tokens, selected in caches if selected]
    # One pass over the training part, or 512 steps of the form's batch size (4096) when more.
    default_tokens = max(int(planted_cache.num_tokens * 0.95), 512 * 4096)
    assert chosen == [(planted_cache.id, str(default_tokens))]
    assert f'placeholder="{default_tokens}"' in form
    assert f'<optgroup label="{planted_cache.id}" data-cache="{planted_cache.id}">' in form
    # Each hook offers the expansion the service would pick there: 8, less on a cache this small.
    expansion = default_expansion(D_IN, int(planted_cache.num_tokens * 0.95))
    assert f'<option value="{HOOK}" data-expansion="{expansion}" selected>{HOOK} · d={D_IN}</option>' in form
    assert '<option value="topk" selected>TopK</option>' in form
    architectures = re.findall(
        r'<option value="(\w+)"[^>]*>', form.split('name="architecture"')[1].split("</select>")[0]
    )
    assert architectures == ["topk", "batchtopk", "matryoshka_batchtopk", "jumprelu", "standard"]
    assert (
        'name="expansion_factor" type="number" min="1" max="1024" step="1" value="" placeholder="8"' in form
    )
    assert re.search(
        r'data-architectures="topk batchtopk matryoshka_batchtopk">\s*<label for="train-k">k</label>\s*'
        r'<input id="train-k" name="k"[^>]*value="" placeholder="d_in ÷ 24, 16 to 128"',
        form,
    )  # empty: sized to the hook's width by the service
    # The hint is the service's rule (it said "4 to 128" while the API used 16 to 128).
    assert "empty: d_in ÷ 24, 16 to 128 (32 for d_in 768)" in form
    dead = r'<input id="train-dead" name="dead_after_steps"[^>]*value="" placeholder="a tenth'
    assert re.search(dead, form)
    assert 'data-architectures="standard"' in form and 'name="l1_coefficient"' in form
    # the cache page links here with its cache chosen
    cache_page = signed_in(writer).get(f"/activations/{planted_cache.id}/").content.decode()
    assert f'href="/saes/?cache={planted_cache.id}#train-card" id="train-sae-link"' in cache_page


def test_posting_the_form_queues_a_training_and_opens_its_page(
    writer, planted_cache, django_capture_on_commit_callbacks
):
    form = {
        "cache_id": planted_cache.id, "hook": HOOK, "architecture": "batchtopk", "expansion_factor": "4",
        "k": "16", "l1_coefficient": "5", "l0_coefficient": "1", "lr": "0.001", "batch_size": "128",
        "total_tokens": "", "b_dec_init": "mean", "name": "my first SAE", "shared": "on",
    }  # fmt: skip
    browser = signed_in(writer)
    shared_queue().empty()  # tokens other tests left
    with django_capture_on_commit_callbacks(execute=True):
        response = browser.post("/saes/", form)
    sae = SparseAutoencoder.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/saes/{sae.id}/"
    assert (sae.status, sae.name, sae.owner, sae.shared) == ("queued", "my first SAE", writer, True)
    assert (sae.architecture, sae.d_in, sae.d_sae, sae.k) == ("batchtopk", D_IN, 4 * D_IN, 16)
    # the other architectures' coefficients were left out; the empty tokens field: one pass, >= 512 steps
    assert "l1_coefficient" not in sae.hyperparameters and "l0_coefficient" not in sae.hyperparameters
    assert sae.hyperparameters["lr"] == 0.001 and sae.hyperparameters["b_dec_init"] == "mean"
    assert sae.total_tokens == max(int(planted_cache.num_tokens * 0.95), 512 * 128)
    assert sae.queue_name == shared_queue().name
    assert [job.func_name for job in shared_queue().jobs] == ["mistudio.job_runner.run_next_job"]

    page = browser.get(response["Location"]).content.decode()
    assert "Training of my first SAE queued." in page  # the message, shown as a toast
    assert 'data-status="queued"' in page and "Waiting for a worker" in page
    assert svg_points(page.split('id="curves"')[1]) == [0, 0, 0, 0]  # "no points yet" until it trains
    assert 'value="cancel"' in page and "Cancel training" in page
    # the standard architecture takes the L1 coefficient, and no k even though the field was posted
    with django_capture_on_commit_callbacks(execute=True):
        browser.post("/saes/", {**form, "architecture": "standard", "name": "l1"})
    standard = SparseAutoencoder.objects.get(name="l1")
    assert standard.k is None and standard.hyperparameters["l1_coefficient"] == 5.0


def test_form_errors_are_shown_in_the_form_with_what_was_typed(writer, planted_cache):
    browser = signed_in(writer)
    form = {"cache_id": planted_cache.id, "hook": "blocks.1.hook_resid_post", "name": "kept name", "k": "16"}
    response = browser.post("/saes/", form)
    page = response.content.decode()
    assert response.status_code == 400
    assert '<div class="form-error" role="alert">The cache has no hook' in page
    assert 'data-error-for="hook"' in page and 'value="kept name"' in page and 'value="16"' in page

    response = browser.post("/saes/", {**form, "hook": HOOK, "batch_size": "0", "lr": "2"})
    page = response.content.decode()
    assert response.status_code == 400
    assert re.search(r'data-error-for="batch_size">[^<]*greater than or equal to 1', page)
    assert re.search(r'data-error-for="lr">[^<]*less than or equal to 1', page)

    response = browser.post("/saes/", {**form, "hook": HOOK, "k": "5000"})
    assert response.status_code == 400 and re.search(
        r"k \(5000\) must not exceed d_sae \(\d+\)", response.content.decode()
    )
    response = browser.post("/saes/", {**form, "cache_id": "act_nosuch"})
    assert response.status_code == 404 and 'data-error-for="cache_id"' in response.content.decode()
    assert not SparseAutoencoder.objects.exists()


def test_a_reader_sees_no_forms_and_cannot_train_or_import(reader, writer, planted_cache):
    page = signed_in(reader).get(f"/saes/?cache={planted_cache.id}").content.decode()
    assert 'id="train-form"' not in page and 'id="import-form"' not in page
    response = signed_in(reader).post("/saes/", {"cache_id": planted_cache.id, "hook": HOOK})
    assert response.status_code == 403 and "needs the model:write role" in response.content.decode()
    assert signed_in(reader).post("/saes/import/", {"local_path": "/x"}).status_code == 403
    assert not SparseAutoencoder.objects.exists()


# --- importing ------------------------------------------------------------------------------------------


def test_importing_a_saelens_folder_from_the_form(writer, tiny_model):
    import torch

    folder = settings.LOCAL_MODEL_ROOTS[0] / "saes" / "page-import"
    module = SaeModule(SaeShape("standard", D_IN, 2 * D_IN, None))
    with torch.no_grad():
        module.W_dec.normal_(0, 0.2)
    save_saelens(module, folder, hook_name=HOOK, model_name="tiny-gpt2")
    browser = signed_in(writer)
    response = browser.post(
        "/saes/import/", {"local_path": str(folder), "format": "auto", "model_id": tiny_model.id, "name": ""}
    )
    sae = SparseAutoencoder.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/saes/{sae.id}/"
    assert (sae.source, sae.name, sae.model, sae.hook_name, sae.d_sae) == (
        "saelens",
        "page-import",
        tiny_model,
        HOOK,
        2 * D_IN,
    )
    page = browser.get(response["Location"]).content.decode()
    assert "no training curves here" in page and 'id="curves"' not in page
    assert f'href="/api/saes/{sae.id}/export" download id="export-sae"' in page

    response = browser.post("/saes/import/", {"local_path": "/etc", "name": "typed"})
    page = response.content.decode()
    assert response.status_code == 400 and "LOCAL_MODEL_ROOTS" in page
    assert 'id="import-panel" open' in page and 'value="typed"' in page and "/etc" in page
    assert SparseAutoencoder.objects.count() == 1


# --- one SAE --------------------------------------------------------------------------------------------


def test_the_sae_page_shows_curves_metrics_hyperparameters_and_links(writer, tiny_model, planted_cache):
    sae = completed_sae(tiny_model, planted_cache, writer)
    SaeEvaluation.objects.create(sae=sae, cache=planted_cache, owner=writer)  # queued
    page = signed_in(writer).get(f"/saes/{sae.id}/").content.decode()
    assert '<a href="/saes/" aria-current="page">SAEs</a>' in page
    assert f'href="/models/{tiny_model.id}/" id="model-link"' in page
    assert f'href="/activations/{planted_cache.id}/" id="cache-link"' in page
    assert 'data-status="completed"' in page and 'class="progress done"' in page
    assert "step 12 / 12" in page and "1.5 s" in page

    curves = page.split('id="curves"')[1].split('id="sae-results"')[0]
    assert re.findall(r'data-curve="(\w+)"', curves) == ["mse", "l0", "explained_variance", "dead"]
    assert svg_points(curves) == [len(HISTORY)] * 4
    assert 'data-testid="latest-dead">0<' in curves and 'data-testid="latest-mse">0.08333<' in curves
    assert "mse, activations scaled to norm √d_in (log scale)" in curves and ">tokens<" in curves
    # The two dead counts say over what each is counted (they disagreed with no word on why).
    assert "Dead features (none active in the last 5 training steps)" in curves
    metrics = page.split('id="sae-metrics"')[1]
    assert "never active on the 204 held-out tokens (the training curve counts" in metrics

    metrics = page.split('id="sae-metrics"')[1].split("</section>")[0]
    for metric, shown in [
        ("mse", "0.0123"), ("explained_variance", "0.9134"), ("fraction_of_variance_unexplained", "0.0866"),
        ("l0", "31.50"), ("dead_features", "7"), ("dense_features", "2"),
    ]:  # fmt: skip
        assert re.search(rf'data-metric="{metric}">.*?<td class="num mono">{shown}</td>', metrics, re.S), (
            metric
        )
    assert 'data-testid="ce-loss-recovered"><span class="muted">pending</span>' in metrics
    assert "evaluation queued" in metrics and "clean_loss" not in metrics

    hyper = page.split('id="hyperparameters"')[1].split("</table>")[0]
    assert re.findall(r"<code>(\w+)</code>", hyper) == [
        "architecture",
        "batch_size",
        "d_sae",
        "dead_after_steps",
        "k",
        "lr",
    ]
    assert f'href="/api/saes/{sae.id}/export" download' in page
    # an evaluation is queued: the button waits; cancel is for trainings in flight only
    assert re.search(r'id="evaluate-sae" disabled', page)
    assert re.search(r'<form method="post" data-when="active" hidden>', page)


def test_ce_loss_recovered_with_its_three_losses_once_evaluated(writer, tiny_model, planted_cache):
    evaluation = {
        **EVALUATION,
        "ce_loss_recovered": 0.91234,
        "clean_loss": 3.25,
        "sae_loss": 3.5,
        "zero_ablation_loss": 6.1,
    }
    sae = completed_sae(tiny_model, planted_cache, writer, evaluation=evaluation)
    metrics = signed_in(writer).get(f"/saes/{sae.id}/?fragment=results").content.decode()
    assert "<html" not in metrics and metrics.count('id="sae-metrics"') == 1 and 'id="about-title"' in metrics
    assert 'data-testid="ce-loss-recovered">0.9123<' in metrics
    for metric, shown in [("clean_loss", "3.2500"), ("sae_loss", "3.5000"), ("zero_ablation_loss", "6.1000")]:
        assert re.search(rf'data-metric="{metric}">.*?<td class="num mono">{shown}</td>', metrics, re.S)
    # not measured, nothing queued: say how to get it
    sae.evaluation = EVALUATION
    sae.save()
    metrics = signed_in(writer).get(f"/saes/{sae.id}/?fragment=results").content.decode()
    assert "pending" not in metrics and "Evaluate runs it" in metrics


def test_the_training_fragment_follows_the_row(writer, tiny_model, planted_cache):
    sae = completed_sae(
        tiny_model, planted_cache, writer, status="running", progress=50, step=6, history=HISTORY[:6],
        eta_seconds=30.4, evaluation={},
    )  # fmt: skip
    browser = signed_in(writer)
    fragment = browser.get(f"/saes/{sae.id}/?fragment=training").content.decode()
    assert "<html" not in fragment and 'data-status="running" data-step="6"' in fragment
    assert svg_points(fragment) == [6] * 4 and 'data-testid="eta">30 s<' in fragment
    sae.mark_progress(
        step=9, tokens_seen=2304, tokens_per_second=1000.0, metrics=HISTORY[8], points=HISTORY[6:9]
    )
    sae.save()
    fragment = browser.get(f"/saes/{sae.id}/?fragment=training").content.decode()
    assert 'data-step="9"' in fragment and svg_points(fragment) == [9] * 4
    assert "<script" not in fragment and "style=" not in fragment  # the CSP: data-width, not style


def test_cancel_evaluate_and_delete_from_the_page(
    writer, tiny_model, planted_cache, django_capture_on_commit_callbacks
):
    browser = signed_in(writer)
    with django_capture_on_commit_callbacks(execute=True):
        browser.post("/saes/", {"cache_id": planted_cache.id, "hook": HOOK, "batch_size": "256"})
    queued = SparseAutoencoder.objects.get()
    with django_capture_on_commit_callbacks(execute=True):
        response = browser.post(f"/saes/{queued.id}/", {"action": "cancel"})
    assert response.status_code == 302 and response["Location"] == f"/saes/{queued.id}/"
    queued.refresh_from_db()
    assert queued.status == "cancelled"
    response = browser.post(f"/saes/{queued.id}/", {"action": "cancel"})  # again: said, not a crash
    assert response.status_code == 302
    assert "The SAE is not queued or running." in browser.get(response["Location"]).content.decode()

    done = completed_sae(tiny_model, planted_cache, writer)
    page = browser.get(f"/saes/{done.id}/").content.decode()
    assert f'<option value="{planted_cache.id}" selected>{planted_cache.id} (training cache)' in page
    with django_capture_on_commit_callbacks(execute=True):
        response = browser.post(f"/saes/{done.id}/", {"action": "evaluate", "cache_id": planted_cache.id})
    done.refresh_from_db()
    assert response.status_code == 302 and done.evaluation_status == "queued"
    evaluation = done.evaluations.get()
    assert (evaluation.cache, evaluation.owner, evaluation.queue_name) == (
        planted_cache,
        writer,
        shared_queue().name,
    )

    response = browser.post(f"/saes/{queued.id}/", {"action": "delete"})
    assert response.status_code == 302 and response["Location"] == "/saes/"
    assert not SparseAutoencoder.objects.filter(pk=queued.id).exists()
    assert browser.post(f"/saes/{done.id}/", {"action": "retrain"}).status_code == 400


def test_another_users_private_sae_is_404_and_a_shared_one_has_no_actions(writer, tiny_model, planted_cache):
    other = make_user("olga-other", "model:write")
    sae = completed_sae(tiny_model, planted_cache, writer)
    browser = signed_in(other)
    for path in ["", "?fragment=training", "?fragment=results"]:
        assert browser.get(f"/saes/{sae.id}/{path}").status_code == 404
    assert browser.get(f"/saes/?fragment=row&sae={sae.id}").status_code == 404
    assert sae.id not in browser.get("/saes/").content.decode()
    assert browser.post(f"/saes/{sae.id}/", {"action": "delete"}).status_code == 404

    sae.shared = True
    sae.save()
    page = browser.get(f"/saes/{sae.id}/").content.decode()
    assert "resid topk" in page and 'id="delete-sae"' not in page and 'id="evaluate-sae"' not in page
    assert 'id="export-sae"' in page  # reading it is allowed
    response = browser.post(f"/saes/{sae.id}/", {"action": "delete"})
    assert response.status_code == 302 and SparseAutoencoder.objects.filter(pk=sae.id).exists()
    assert "Only the owner of this SAE" in browser.get(response["Location"]).content.decode()


def test_the_model_page_lists_its_saes(writer, tiny_model, planted_cache):
    sae = completed_sae(tiny_model, planted_cache, writer)
    page = signed_in(writer).get(f"/models/{tiny_model.id}/").content.decode()
    table = page.split('id="model-sae-table"')[1].split("</table>")[0]
    assert f'href="/saes/{sae.id}/"' in table and f"<code>{HOOK}</code>" in table
    assert f'href="/saes/?model={tiny_model.id}"' in page
    listed = signed_in(writer).get(f"/saes/?model={tiny_model.id}").content.decode()
    assert sae.id in listed and "show all" in listed
    assert sae.id not in signed_in(writer).get("/saes/?model=m_nosuch").content.decode()


def test_the_group_form_follows_the_chosen_model_and_offers_a_transcoder_per_layer(
    tiny_model, tiny_llama_folder, writer
):
    """Before: the suggestion and placeholders kept the first model's values when another was
    chosen, nothing said a graph needs a transcoder per layer, and the CPU default meant hours."""
    import json

    from activations.services import dataset_create_from_texts
    from models_app.services import model_register

    wide = model_register(source="local", identifier=str(tiny_llama_folder), name="zz-wide", owner=writer)
    LanguageModel.objects.filter(pk=wide.pk).update(hidden_size=256, num_layers=4)
    dataset_create_from_texts(name="d", texts=["a b"], owner=writer, source="upload")
    page = signed_in(writer).get("/saes/groups/new/").content.decode()
    import html

    data = re.search(r'id="group-form" class="train-form" novalidate data-suggestions="([^"]*)"', page)
    suggestions = json.loads(html.unescape(data.group(1)))
    mine, other = suggestions[tiny_model.id], suggestions[wide.pk]
    assert (mine["d_in"], other["d_in"]) == (64, 256) and other["k"] == 21 and other["d_sae"] == 4096
    assert other["transcoders"].splitlines() == [
        f"blocks.{layer}.ln2.hook_normalized -> blocks.{layer}.hook_mlp_out" for layer in range(4)
    ]
    assert mine["device"] == "cpu" and mine["minutes"] == 10 and "assumed" in mine["rate"]
    assert mine["k_rule"] == "d_in ÷ 12, 16 to 128" and mine["analyze_members"] is True
    assert (
        'id="group-transcoder-per-layer"' in page
        and 'name="analyze_members" id="group-analyze" checked' in page
    )
    assert "frontend/sae_group_new.js" in page
