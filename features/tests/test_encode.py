"""Live inference — "which features fire on my text" — against the cache of the same text.

The tiny GPT-2 is loaded in a real worker; the text is extracted into an activation cache by the
real extraction job, and the SAE's encoding of those cached rows is the reference the API's
answer must equal (the request waits in a thread while the worker answers it).
"""

import threading

import numpy as np
import pytest
import torch

from activations.models import Dataset, ExtractionJob
from activations.services import dataset_create_from_texts
from activations.store import ActivationStore
from engine.sae.formats import load_saelens
from features.tests.conftest import completed_sae_row
from mistudio.access import OPERATOR
from mistudio.workers import interactive_queue, run_worker
from models_app.services import model_load_request
from models_app.tests.live_stack import wait_until
from saes.tests.conftest import HOOK

pytestmark = pytest.mark.django_db(transaction=True)
TEXT = "The researcher must label the feature before she can find it again by search."


def burst() -> None:
    run_worker(name="encode-worker", device="cpu", burst=True)


def test_live_encoding_equals_encoding_the_cached_activations(tiny_model, planted_cache, writer, client_for):
    api = client_for(writer)
    model_load_request(model_id=tiny_model.id, actor=OPERATOR)
    burst()  # the model is loaded here, in "encode-worker"
    dataset = dataset_create_from_texts(name="one", texts=[TEXT], owner=None, source=Dataset.Source.BUILTIN)
    extraction = api.post(
        f"/api/models/{tiny_model.id}/extract-activations",
        {"dataset_id": dataset.id, "hooks": [HOOK], "max_length": 64},
        format="json",
    ).json()
    burst()
    cache = ExtractionJob.objects.get(pk=extraction["extraction_id"]).cache
    store = ActivationStore.open(cache.directory)
    sae = completed_sae_row(tiny_model, planted_cache, writer)
    module, _ = load_saelens(sae.directory)
    with torch.no_grad():
        reference = module.encode(torch.from_numpy(np.asarray(store.get(HOOK))).float()).numpy()

    answer = {}

    def ask() -> None:
        answer["response"] = api.post(f"/api/saes/{sae.id}/encode", {"text": TEXT, "top": 5}, format="json")

    asking = threading.Thread(target=ask)
    asking.start()
    wait_until(lambda: interactive_queue("encode-worker").count > 0, timeout=30, what="the encode job")
    burst()  # answers it
    asking.join(timeout=60)
    response = answer["response"]
    assert response.status_code == 200, response.content
    body = response.json()

    assert body["token_ids"] == store.tokens()["token_ids"].tolist()
    assert len(body["per_token"]) == len(reference)
    for row, features in zip(reference, body["per_token"], strict=True):
        expected = np.argsort(-row, kind="stable")[:5]
        expected = [int(index) for index in expected if row[index] > 0]
        assert [entry["index"] for entry in features] == expected
        np.testing.assert_allclose(
            [entry["value"] for entry in features], row[expected], rtol=1e-4, atol=1e-5
        )
    peak = reference.max(axis=0)
    top = [int(index) for index in np.argsort(-peak, kind="stable")[:5] if peak[index] > 0]
    assert [entry["index"] for entry in body["overall"]] == top
    assert body["overall"][0]["max"] == pytest.approx(float(peak[top[0]]), rel=1e-4)
    assert body["overall"][0]["tokens_firing"] == int((reference[:, top[0]] > 0).sum())
