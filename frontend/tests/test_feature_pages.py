"""The feature pages as the server renders them (Django test client) over a real analysis: a
completed SAE over the planted cache, analysed by a real worker in burst mode (as
features/tests/test_analysis_job.py does). The SAE page's Features card (run, live parts, cancel),
the feature list (filters, sorting, paging, search by label and token, go to an index), one
feature's dashboard (the numbers of ``selectors.feature_detail``, heatmap examples, logit effects,
similar features, keyboard-navigation links, the label form) and "which features fire on my text"
(its error when the model is not loaded); errors shown on the pages."""

import html
import re

import pytest
from django.test import Client

from conftest import make_user
from features import selectors, services
from features.models import Feature, FeatureAnalysis, FeatureLabel
from features.tests.conftest import completed_sae_row
from mistudio.workers import run_worker
from models_app.models import LanguageModel
from models_app.services import model_register
from saes.tests.conftest import write_planted_cache

pytestmark = pytest.mark.django_db(transaction=True)


def signed_in(user) -> Client:
    browser = Client()
    browser.force_login(user)
    return browser


@pytest.fixture
def tiny_model(tiny_gpt2_folder, writer):
    return model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny-gpt2", owner=writer)


@pytest.fixture
def sae(tiny_model, writer):
    cache = write_planted_cache(tiny_model, writer, samples=64)
    return completed_sae_row(tiny_model, cache, writer, shared=True)


def analysed(sae, owner) -> FeatureAnalysis:
    """A completed analysis of ``sae`` over its training cache, run by a real worker, shared as the
    SAE is (sharing one's examples of the cache's text is a choice of its own)."""
    analysis = services.analysis_request(owner=owner, sae=sae, shared=sae.shared)
    run_worker(name="feature-pages-worker", device="cpu", burst=True)
    analysis.refresh_from_db()
    assert analysis.status == "completed", (analysis.error_code, analysis.error_message)
    return analysis


def indices(page: str) -> list[int]:
    """The feature indices of the list's rows, in order."""
    return [int(index) for index in re.findall(r'<tr data-index="(\d+)"', page)]


def a_live_feature(analysis) -> Feature:
    """A feature that fires, but not on everything: the densest below a quarter of the tokens."""
    return (
        Feature.objects.filter(analysis=analysis, density__gt=0, density__lt=0.25)
        .order_by("-density")
        .first()
    )


# --- the SAE page's Features card ----------------------------------------------------------------------


def test_the_sae_page_runs_an_analysis_shows_its_progress_and_links_its_features(sae, writer):
    browser = signed_in(writer)
    page = browser.get(f"/saes/{sae.id}/").content.decode()
    assert 'id="features"' in page and 'id="analysis-form"' in page
    assert f'<option value="{sae.cache_id}" selected>{sae.cache_id} (training cache)' in page
    assert 'id="no-analyses"' in page

    response = browser.post(f"/saes/{sae.id}/analyses/", {"action": "run", "cache_id": sae.cache_id})
    assert response.status_code == 302 and response["Location"] == f"/saes/{sae.id}/#features"
    analysis = FeatureAnalysis.objects.get(sae=sae)
    assert (analysis.status, analysis.cache_id, analysis.owner) == ("queued", sae.cache_id, writer)
    # A second one over the same cache while the first is queued: the service's refusal, shown.
    again = browser.post(f"/saes/{sae.id}/analyses/", {"action": "run"}, follow=True)
    assert "already running" in html.unescape(again.content.decode())
    assert FeatureAnalysis.objects.filter(sae=sae).count() == 1

    # The live part as saes.js fetches it while the job runs: phase, percent, tokens/s, ETA, cancel.
    analysis.save(update_fields=analysis.mark_running(host_worker="w-1", tokens=analysis.tokens))
    analysis.save(update_fields=analysis.mark_progress(phase=2, fraction=0.4, tokens_per_second=1234.4))
    part = browser.get(f"/saes/{sae.id}/?fragment=analyses").content.decode()
    assert f'data-analysis-id="{analysis.id}" data-status="running" data-active' in part
    assert "pass 2 of 3" in part and 'data-testid="analysis-percent">40 %<' in part
    assert ">1234<" in part and f'data-testid="analysis-eta">{analysis.eta_seconds:.0f} s<' in part
    assert 'data-testid="cancel-analysis"' in part
    # Another writer sees the shared SAE's analysis, but it is not theirs to cancel.
    other = signed_in(make_user("olga-other", "model:write"))
    assert (
        'data-testid="cancel-analysis"'
        not in other.get(f"/saes/{sae.id}/?fragment=analyses").content.decode()
    )

    cancelled = browser.post(f"/saes/{sae.id}/analyses/", {"action": "cancel", "analysis": analysis.id})
    assert cancelled.status_code == 302
    run_worker(name="feature-pages-worker", device="cpu", burst=True)  # the job finds it cancelled
    analysis.refresh_from_db()
    assert analysis.status == "cancelled"
    assert (
        "Cancelled; its files were removed."
        in browser.get(f"/saes/{sae.id}/?fragment=analyses").content.decode()
    )

    done = analysed(sae, writer)
    part = browser.get(f"/saes/{sae.id}/?fragment=analyses").content.decode()
    assert f'data-analysis-id="{done.id}" data-status="completed"' in part
    assert f'href="/saes/{sae.id}/features/?analysis={done.id}" data-testid="browse-features"' in part
    assert f'data-testid="analysis-dead">{done.summary["dead"]}<' in part
    # The SAE list links the features of an SAE that has some.
    listing = browser.get("/saes/").content.decode()
    assert f'href="/saes/{sae.id}/features/" data-testid="features-link"' in listing

    unknown = browser.post(f"/saes/{sae.id}/analyses/", {"action": "explode"})
    assert unknown.status_code == 400
    reader = signed_in(make_user("rita-reader", "model:read"))
    assert reader.post(f"/saes/{sae.id}/analyses/", {"action": "run"}).status_code == 403
    assert 'id="analysis-form"' not in reader.get(f"/saes/{sae.id}/").content.decode()


# --- the feature list ----------------------------------------------------------------------------------


def test_the_feature_list_filters_sorts_pages_and_finds_by_label_or_token(sae, writer):
    analysis = analysed(sae, writer)
    browser = signed_in(writer)
    url = f"/saes/{sae.id}/features/"
    rows = list(Feature.objects.filter(analysis=analysis))
    page = browser.get(url).content.decode()
    assert f'data-testid="analysis-id">{analysis.id}<' in page
    assert 'data-testid="feature-total">96 features<' in page
    assert indices(page) == list(range(50))  # by index, 50 a page
    assert f'href="/saes/{sae.id}/features/0/"' in page
    assert '<a href="/saes/" aria-current="page">SAEs</a>' in page

    # The numbers of each row are the selector's (the API's) numbers.
    first = selectors.feature_page(user=writer, sae=sae, analysis=analysis, filters={}, page=1, page_size=50)
    row = re.search(r'<tr data-index="5".*?</tr>', page, re.S).group(0)
    expected = first["features"][5]
    assert f'data-testid="density">{expected["density"] * 100:.3g} %<' in row
    assert f'data-testid="max">{expected["max_activation"]:.4g}<' in row

    densest = browser.get(url, {"sort": "-density", "page_size": 25}).content.decode()
    by_density = sorted(rows, key=lambda feature: (-feature.density, feature.index))
    assert indices(densest) == [feature.index for feature in by_density[:25]]
    # Its header link now sorts the other way round.
    assert re.search(r'<a href="\?[^"]*sort=density[^"]*"[^>]*id="sort-density"', densest)
    second = browser.get(url, {"sort": "-density", "page_size": 25, "page": 2}).content.decode()
    assert indices(second) == [feature.index for feature in by_density[25:50]]
    assert 'rel="prev"' in second and "page 2 of 4" in second

    dead = browser.get(url, {"dead": "yes", "page_size": 200}).content.decode()
    assert indices(dead) == sorted(feature.index for feature in rows if feature.density == 0)
    alive = browser.get(url, {"dead": "no", "page_size": 200}).content.decode()
    assert len(indices(alive)) == len(rows) - len(indices(dead))
    ranged = browser.get(url, {"density_min": "0.01", "density_max": "0.05", "page_size": 200})
    assert indices(ranged.content.decode()) == sorted(
        feature.index for feature in rows if 0.01 <= feature.density <= 0.05
    )

    live = a_live_feature(analysis)
    services.feature_label_set(sae=sae, index=live.index, actor=writer, label="planted atom")
    found = browser.get(url, {"q": "PLANTED"}).content.decode()
    assert indices(found) == [live.index]
    assert 'data-testid="label">planted atom<' in found
    assert indices(browser.get(url, {"labelled": "yes"}).content.decode()) == [live.index]
    token = live.top_tokens.strip("|").split("|")[0]
    by_token = indices(browser.get(url, {"token": token, "page_size": 200}).content.decode())
    assert live.index in by_token
    assert all(f"|{token}|" in rows[index].top_tokens for index in by_token)

    # Go to a feature by its index; a bad one is said, and the list stays.
    going = browser.get(url, {"index": "7"})
    assert going.status_code == 302 and going["Location"] == f"/saes/{sae.id}/features/7/"
    wrong = browser.get(url, {"index": "960"}, follow=True)
    assert "No feature &#x27;960&#x27;" in wrong.content.decode()

    # A bad filter: its error, and the unfiltered list.
    bad = browser.get(url, {"density_min": "2"})
    assert bad.status_code == 400
    assert "density_min" in bad.content.decode() and len(indices(bad.content.decode())) == 50

    # "Which features fire on my text?" says to load the model only while it is not loaded.
    LanguageModel.objects.filter(pk=sae.model_id).update(status="unloaded")
    assert 'data-testid="encode-needs-model">Load <a href="/models/' in browser.get(url).content.decode()
    LanguageModel.objects.filter(pk=sae.model_id).update(status="ready")
    assert 'data-testid="encode-needs-model"' not in browser.get(url).content.decode()


def test_the_feature_list_without_an_analysis_says_how_to_get_one(sae, writer):
    page = signed_in(writer).get(f"/saes/{sae.id}/features/")
    assert page.status_code == 200 and 'id="no-analysis"' in page.content.decode()
    assert f'href="/saes/{sae.id}/#features"' in page.content.decode()
    missing = signed_in(writer).get(f"/saes/{sae.id}/features/", {"analysis": "fan_nope"})
    assert missing.status_code == 404 and "No such feature analysis" in missing.content.decode()


# --- one feature ---------------------------------------------------------------------------------------


def test_the_feature_page_shows_the_dashboard_of_feature_detail(sae, writer):
    analysis = analysed(sae, writer)
    live = a_live_feature(analysis)
    detail = selectors.feature_detail(user=writer, sae=sae, analysis=analysis, index=live.index)
    browser = signed_in(writer)
    response = browser.get(f"/saes/{sae.id}/features/{live.index}/")
    assert response.status_code == 200
    page = response.content.decode()

    assert f'data-testid="density" title="{detail["density"]}">{detail["density"] * 100:.3g} %<' in page
    assert f'data-testid="max" title="{detail["max_activation"]}">{detail["max_activation"]:.4g}<' in page
    assert f'data-testid="mean" title="{detail["mean_activation"]}">' in page
    assert f'data-testid="nonzero">{detail["nonzero_count"]}<' in page
    assert html.escape(detail["auto_label"]) in page
    # The histogram: one bar per bin, as many values as the feature has non-zero ones.
    histogram = re.search(r'id="activation-histogram">(.*?)</div>', page, re.S).group(1)
    counts = [int(count) for count in re.findall(r'class="bar-fill"[^>]*data-count="(\d+)"', histogram)]
    assert counts == detail["histogram"]["counts"] and sum(counts) == detail["nonzero_count"]

    # Top examples: the feature's values, each context a heatmap with its picked token outlined.
    top = re.search(r'id="top-examples".*?</section>', page, re.S).group(0)
    values = [float(value) for value in re.findall(r'<span class="value" data-value="([^"]+)"', top)]
    assert values == [example["value"] for example in detail["top_examples"]]
    assert top.count("tok pos") + top.count("tok neg") == sum(
        len(example["token_ids"]) for example in detail["top_examples"]
    )
    assert len(re.findall(r'class="tok [^"]*\bcenter\b', top)) == len(detail["top_examples"])
    first = detail["top_examples"][0]
    assert f"feature {live.index} = {first['values'][first['center']]:.6g}" in html.unescape(top)
    assert re.search(r'class="tok pos strong center"', top)  # the top value is full strength
    # Interval examples, grouped by their interval, highest first.
    intervals = re.findall(r'class="interval" data-low="([^"]+)" data-high="([^"]+)"', page)
    expected = sorted({tuple(example["interval"]) for example in detail["interval_examples"]}, reverse=True)
    assert [(float(low), float(high)) for low, high in intervals] == expected

    # Logit effects (the burst worker loaded the model for its unembedding) and similar features.
    promoted = re.search(r'id="promoted">.*?</table>', page, re.S).group(0)
    assert promoted.count("<tr>") == len(detail["logit_effects"]["top"]) == 10
    assert f"{detail['logit_effects']['top'][0]['value']:.3f}" in promoted
    assert 'id="suppressed"' in page and 'id="logit-histogram"' in page
    for entry in detail["similar"]:
        assert f'<a class="mono" href="/saes/{sae.id}/features/{entry["index"]}/">' in page

    # Keyboard navigation goes where the previous / next links go: index ± 1, none past the ends.
    assert f'href="/saes/{sae.id}/features/{live.index - 1}/" id="previous-feature"' in page
    assert f'href="/saes/{sae.id}/features/{live.index + 1}/" id="next-feature"' in page
    assert 'aria-keyshortcuts="ArrowLeft k"' in page and "features.js" in page
    # "Steer" opens the playground with the SAE's model and this feature preset.
    steer_url = f"/playground/?model={sae.model_id}&sae={sae.id}&feature={live.index}"
    assert f'href="{html.escape(steer_url)}" id="steer-feature"' in page and "next release" not in page
    playground = browser.get(steer_url).content.decode()
    assert f'id="steer-index" min="0" step="1" value="{live.index}"' in playground
    first_page = browser.get(f"/saes/{sae.id}/features/0/").content.decode()
    assert 'id="previous-feature"' not in first_page and 'id="next-feature"' in first_page
    last_page = browser.get(f"/saes/{sae.id}/features/{sae.d_sae - 1}/").content.decode()
    assert 'id="next-feature"' not in last_page and 'id="previous-feature"' in last_page
    # A named analysis stays named in the links.
    named = browser.get(f"/saes/{sae.id}/features/{live.index}/", {"analysis": analysis.id}).content.decode()
    assert f'href="/saes/{sae.id}/features/{live.index + 1}/?analysis={analysis.id}"' in named

    # A dead feature says so; out of range and missing files are errors on the page.
    dead = Feature.objects.filter(analysis=analysis, density=0).first()
    dead_page = browser.get(f"/saes/{sae.id}/features/{dead.index}/").content.decode()
    assert "never fired on the cache" in dead_page
    beyond = browser.get(f"/saes/{sae.id}/features/{sae.d_sae}/")
    assert beyond.status_code == 404 and "FEATURE_NOT_FOUND" in beyond.content.decode()
    analysis.data_path.unlink()
    broken = browser.get(f"/saes/{sae.id}/features/{live.index}/")
    assert broken.status_code == 409 and "ANALYSIS_FILES_MISSING" in broken.content.decode()


def test_the_label_form_saves_shares_and_removes_a_label(sae, writer):
    analysis = analysed(sae, writer)
    live = a_live_feature(analysis)
    url = f"/saes/{sae.id}/features/{live.index}/"
    browser = signed_in(writer)
    saved = browser.post(url, {"label": "planted atom", "notes": "row 5\nand 9", "shared": "on"})
    assert saved.status_code == 302 and saved["Location"] == url
    label = FeatureLabel.objects.get(sae=sae, index=live.index)
    assert (label.label, label.notes, label.shared, label.owner) == (
        "planted atom",
        "row 5\nand 9",
        True,
        writer,
    )
    page = browser.get(url).content.decode()
    assert 'data-testid="feature-label">planted atom<' in page
    assert 'value="planted atom"' in page and ">row 5\nand 9</textarea>" in page

    # Another writer sees the shared label among others' labels, and keeps their own apart.
    other_user = make_user("olga-other", "model:write")
    other = signed_in(other_user)
    theirs = other.get(url).content.decode()
    assert 'id="other-labels"' in theirs and "by walt-writer" in theirs
    other.post(url, {"label": "mine", "notes": ""})
    assert FeatureLabel.objects.filter(sae=sae, index=live.index).count() == 2
    assert "by olga-other" not in browser.get(url).content.decode()  # not shared: not shown to others

    too_long = browser.post(url, {"label": "x" * 201, "notes": ""})
    assert too_long.status_code == 400 and "label" in too_long.content.decode()
    removed = browser.post(url, {"label": "", "notes": ""})
    assert removed.status_code == 302
    assert not FeatureLabel.objects.filter(sae=sae, index=live.index, owner=writer).exists()
    reader = signed_in(make_user("rita-reader", "model:read"))
    assert reader.post(url, {"label": "x", "notes": ""}).status_code == 403
    assert 'id="label-form"' not in reader.get(url).content.decode()


def test_the_feature_page_before_any_analysis(sae, writer):
    page = signed_in(writer).get(f"/saes/{sae.id}/features/3/")
    assert page.status_code == 404 and "NO_ANALYSIS" in page.content.decode()
    assert f'href="/saes/{sae.id}/#features"' in page.content.decode()
    # Its neighbours are still linked, so a reader can move on.
    assert f'href="/saes/{sae.id}/features/4/" id="next-feature"' in page.content.decode()


# --- which features fire on my text --------------------------------------------------------------------


def test_encoding_a_text_needs_the_model_loaded_and_says_where_to_load_it(sae, writer, tiny_model):
    browser = signed_in(writer)
    url = f"/saes/{sae.id}/encode/"
    page = browser.get(url).content.decode()
    assert 'id="model-not-loaded"' in page and f'href="/models/{tiny_model.id}/"' in page

    refused = browser.post(url, {"text": "The river runs down to the sea", "top": "5"})
    assert refused.status_code == 409
    page = refused.content.decode()
    assert 'data-code="MODEL_NOT_LOADED"' in page
    assert f'<a href="/models/{tiny_model.id}/" id="load-model-link">' in page
    assert ">The river runs down to the sea</textarea>" in page  # the text stays

    empty = browser.post(url, {"text": "", "top": "5"})
    assert empty.status_code == 400 and "text" in empty.content.decode()
    reader = signed_in(make_user("rita-reader", "model:read"))
    assert reader.post(url, {"text": "hi"}).status_code == 403


def test_an_sae_trained_from_the_model_is_analysed_from_its_page_without_a_cache(tiny_model, writer):
    """Before: its Features card said "No completed cache … extract one" and offered nothing."""
    from activations.services import dataset_create_from_texts

    other = make_user("olga-other", "model:write")
    theirs = dataset_create_from_texts(name="theirs", texts=["a b c", "d e f"], owner=other, source="upload")
    theirs.shared = True
    theirs.save(update_fields=["shared"])
    mine = dataset_create_from_texts(
        name="my prose", texts=["The cat sat on the mat.", "A dog ran."] * 4, owner=writer, source="upload"
    )
    sae = completed_sae_row(tiny_model, None, writer)
    sae.dataset = mine
    sae.save(update_fields=["dataset"])
    browser = signed_in(writer)

    page = browser.get(f"/saes/{sae.id}/").content.decode()
    assert 'id="no-analysis-cache"' not in page
    options = re.findall(r'<option value="(ds_\w+)"( selected)?>([^<]*)</option>', page)
    assert [value for value, _, _ in options] == [mine.id, theirs.id]  # one's own first
    assert options[0][1] == " selected" and "(training dataset)" in options[0][2]

    browser.post(f"/saes/{sae.id}/analyses/", {"action": "run", "source": mine.id})
    analysis = FeatureAnalysis.objects.get(sae=sae)
    assert analysis.source == "model" and analysis.dataset_id == mine.id and analysis.cache_id is None
    run_worker(name="feature-pages-worker", device="cpu", burst=True)
    analysis.refresh_from_db()
    assert analysis.status == "completed", (analysis.error_code, analysis.error_message)
    listed = browser.get(f"/saes/{sae.id}/?fragment=analyses").content.decode()
    assert "<code>my prose</code> read through the model (8 samples of up to 128 tokens, no cache)" in listed
    assert Feature.objects.filter(analysis=analysis).count() == sae.d_sae
