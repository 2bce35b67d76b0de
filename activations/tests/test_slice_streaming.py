"""A large JSON slice is streamed, encoded off the thread Django's synchronous views share: while
one user reads two million values, another user's API requests keep answering (live web process)."""

import json
import threading
import time
import urllib.request

import numpy as np
import pytest

from activations.models import ActivationCache, Dataset
from activations.services import dataset_create_from_texts
from activations.store import CacheWriter
from models_app.services import model_register
from models_app.tests.live_stack import running_web

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROWS, WIDTH = 16_384, 128  # 2,097,152 values: about 40 MB of JSON


@pytest.fixture
def wide_cache(tiny_gpt2_folder, writer):
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=writer)
    dataset = dataset_create_from_texts(name="d", texts=["x"], owner=writer, source=Dataset.Source.UPLOAD)
    cache = ActivationCache.objects.create(
        key_hash="f" * 64, key={"wide": True}, model=model, dataset=dataset, hooks=["h"], max_length=8,
        dtype="float32", status="completed", owner=writer,
    )  # fmt: skip
    values = np.random.default_rng(0).standard_normal((ROWS, WIDTH), dtype=np.float32)
    values[5, 7], values[6, 8] = np.nan, np.inf  # JSON has neither: they come back as null
    store = CacheWriter.create_or_resume(
        cache.directory, key=cache.key, provenance={}, hooks={"h": WIDTH}, dtype="float32"
    )
    store.add_batch(
        0, token_ids=np.arange(ROWS), sample_index=np.zeros(ROWS, dtype=np.int64), positions=np.arange(ROWS),
        activations={"h": values},
    )  # fmt: skip
    store.finalize(num_samples=1)
    return cache, values


def timed_get(url: str, token: str, result: dict) -> None:
    started = time.monotonic()
    request = urllib.request.Request(url, headers={"Authorization": f"Token {token}"})
    with urllib.request.urlopen(request, timeout=120) as response:
        result["body"] = response.read()
    result["seconds"] = time.monotonic() - started


def test_a_large_json_slice_streams_while_other_requests_answer(wide_cache, writer, reader, tmp_path):
    cache, values = wide_cache
    with running_web(tmp_path / "web.log") as (base_url, _):
        large, small = {}, {}
        slice_url = f"{base_url}/api/activation-caches/{cache.id}/slice?hook=h&start=0&stop={ROWS}"
        reading = threading.Thread(target=timed_get, args=(slice_url, writer.auth_token.key, large))
        reading.start()
        time.sleep(0.3)  # the slice is being produced
        timed_get(f"{base_url}/api/models", reader.auth_token.key, small)  # a synchronous DRF view
        reading.join()

    body = json.loads(large["body"])
    assert body["shape"] == [ROWS, WIDTH] and body["stop"] == ROWS
    expected = values.astype(object)
    expected[5, 7] = expected[6, 8] = None
    assert body["values"][5][7] is None and body["values"][6][8] is None
    got = np.array(
        [[np.nan if value is None else value for value in row] for row in body["values"]], np.float32
    )
    finite = np.isfinite(values)
    np.testing.assert_array_equal(got[finite], values[finite])
    # Before: the other request waited for the whole slice to be encoded in the shared thread.
    assert small["seconds"] < large["seconds"] / 3, (small["seconds"], large["seconds"])
