"""A feature analysis straight from the model (no cache written) against one over a cache.

The same tokens read two ways, each through the whole stack (API → queue → a real worker): an
extraction writes a cache that an analysis then sweeps, and an analysis reads the dataset through
the model itself. Every array of the two analyses (statistics, top and interval examples,
histograms, contexts, logit effects) and every dashboard must be equal, exactly."""

import numpy as np
import pytest
from safetensors.numpy import load_file

from activations.models import ActivationCache
from activations.services import dataset_create_from_texts
from conftest import make_user
from engine.autointerp.pipeline import InterpretationConfig
from engine.testing.corpus import local_corpus
from features.explanation_tasks import non_activating_examples
from features.models import Feature, FeatureAnalysis
from features.services import MODEL_ANALYSIS_TOKENS
from features.tests.conftest import completed_sae_row
from mistudio import workers
from mistudio.workers import run_worker
from saes.groups import FORWARD_TOKENS
from saes.tests.conftest import HOOK

pytestmark = pytest.mark.django_db(transaction=True)
MAX_LENGTH = 32


WORKER = "model-analysis-worker"


def burst() -> None:
    run_worker(name=WORKER, device="cpu", burst=True)


@pytest.fixture
def prose(writer):
    return dataset_create_from_texts(name="prose", texts=local_corpus()[:40], owner=writer, source="upload")


def analyse(api, sae, body) -> FeatureAnalysis:
    response = api.post(f"/api/saes/{sae.id}/analyses", body, format="json")
    assert response.status_code == 202, response.content
    burst()
    analysis = FeatureAnalysis.objects.get(pk=response.json()["id"])
    assert analysis.status == "completed", (analysis.error_code, analysis.error_message)
    return analysis


def test_an_analysis_from_the_model_equals_one_over_a_cache_of_the_same_tokens(
    tiny_model, prose, writer, client_for, monkeypatch
):
    api = client_for(writer)
    # The cache: the batches an analysis from the model runs (FORWARD_TOKENS a forward pass).
    response = api.post(
        f"/api/models/{tiny_model.id}/extract-activations",
        {"dataset_id": prose.id, "hooks": [HOOK], "max_length": MAX_LENGTH, "dtype": "float32",
         "batch_size": FORWARD_TOKENS // MAX_LENGTH},
        format="json",
    )  # fmt: skip
    assert response.status_code == 202, response.content
    burst()
    cache = ActivationCache.objects.get(status="completed")
    sae = completed_sae_row(tiny_model, cache, writer)

    over_cache = analyse(api, sae, {"cache_id": cache.id})
    from_model = analyse(api, sae, {"dataset_id": prose.id, "max_length": MAX_LENGTH})

    state = api.get(f"/api/saes/{sae.id}/analyses/{from_model.id}").json()
    assert state["source"] == "model" and state["dataset_id"] == prose.id and state["cache_id"] is None
    assert (
        state["reading"]["sample_count"] == prose.sample_count
        and state["reading"]["max_length"] == MAX_LENGTH
    )
    assert ActivationCache.objects.count() == 1  # nothing written for it
    assert from_model.summary["tokens"] == over_cache.summary["tokens"] == cache.num_tokens
    assert from_model.summary["forward_passes"] >= 1

    cached, computed = load_file(str(over_cache.data_path)), load_file(str(from_model.data_path))
    assert cached.keys() == computed.keys() and "logit_top_ids" in cached
    for name in cached:
        np.testing.assert_array_equal(computed[name], cached[name], err_msg=name)
    assert (cached["density"] > 0).sum() > 10  # features that fire: the comparison means something

    def rows(analysis):
        return list(
            Feature.objects.filter(analysis=analysis).values_list("density", "max_activation", "auto_label")
        )

    assert rows(from_model) == rows(over_cache)
    densest = int(np.argmax(cached["density"]))
    pages = [
        api.get(f"/api/saes/{sae.id}/features/{densest}", {"analysis": analysis.id}).json()
        for analysis in (over_cache, from_model)
    ]
    for page in pages:
        page.pop("analysis_id", None)
    assert pages[0]["top_examples"] and pages[0] == pages[1]

    # The explanations' quiet contexts (scored against) read the same rows: the model's, run again
    # in the worker that holds it.
    monkeypatch.setattr(workers, "CURRENT_WORKER", workers.WorkerIdentity(name=WORKER, device="cpu"))
    config = InterpretationConfig()
    quiet = [
        non_activating_examples(
            analysis, [densest, 5], config, tokenizer=None, device="cpu", job_row=analysis
        )
        for analysis in (over_cache, from_model)
    ]
    assert quiet[0][5] and quiet[0] == quiet[1]


def test_an_sae_trained_from_the_model_is_analysed_through_it_by_default(
    tiny_model, prose, writer, reader, client_for
):
    sae = completed_sae_row(tiny_model, None, writer)
    sae.dataset = prose
    sae.save(update_fields=["dataset"])
    api = client_for(writer)

    analysis = analyse(api, sae, {})
    assert analysis.source == "model" and analysis.dataset_id == prose.id and analysis.cache_id is None
    samples = min(prose.sample_count, -(-MODEL_ANALYSIS_TOKENS // 128))
    assert analysis.reading["sample_count"] == samples
    assert Feature.objects.filter(analysis=analysis).count() == sae.d_sae

    # Another user's private dataset is not theirs to read through the model.
    sae.shared = True
    sae.save(update_fields=["shared"])
    other = client_for(make_user("olga-other", "model:write"))
    other = other.post(f"/api/saes/{sae.id}/analyses", {"dataset_id": prose.id}, format="json")
    assert other.status_code == 404 and other.json()["error"]["code"] == "DATASET_NOT_FOUND"


def test_an_sae_with_neither_a_cache_nor_a_dataset_names_what_it_needs(tiny_model, writer, client_for):
    sae = completed_sae_row(tiny_model, None, writer)
    api = client_for(writer)
    response = api.post(f"/api/saes/{sae.id}/analyses", {}, format="json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "CACHE_REQUIRED"
    both = api.post(
        f"/api/saes/{sae.id}/analyses", {"cache_id": "act_x", "dataset_id": "ds_x"}, format="json"
    )
    assert both.status_code in (400, 404)


def test_top_examples_leave_out_repeated_contexts(tiny_model, writer, client_for):
    """Before: a dataset with a repeated sample filled a dashboard with the same context again and
    again (near-duplicates at equal strength)."""
    texts = ["The cat sat on the mat because it was warm."] * 12 + local_corpus()[:4]
    repeated = dataset_create_from_texts(name="repeats", texts=texts, owner=writer, source="upload")
    sae = completed_sae_row(tiny_model, None, writer)
    api = client_for(writer)
    analysis = analyse(api, sae, {"dataset_id": repeated.id, "max_length": MAX_LENGTH})
    arrays = load_file(str(analysis.data_path))
    checked = 0
    for index in np.argsort(-arrays["density"])[:8]:
        stored = [tuple(row[row >= 0]) for row in arrays["top_context_tokens"][index] if (row >= 0).any()]
        page = api.get(f"/api/saes/{sae.id}/features/{int(index)}", {"analysis": analysis.id}).json()
        shown = [(example["center"], *example["token_ids"]) for example in page["top_examples"]]
        assert len(shown) == len(set(shown))  # no context twice
        assert {window[1:] for window in shown} == set(stored)  # and none lost
        checked += len(stored) > len(set(stored))
    assert checked  # the repeated sample did repeat in the stored top examples
