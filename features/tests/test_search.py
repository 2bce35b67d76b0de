"""Search features by meaning (``features.search``): ranking by the real all-MiniLM-L6-v2,
visibility, freshness (the index rebuilt by a worker, never in a query; fresh rows found at once by
the query's exact step), the API route and the command.

The world: walt's shared SAE and analysis; a shared explanation job (visible to rita), a private
one of 40 explanations about volcanoes (walt's only), walt's shared and private labels and
rita's own private label; its index built, as the worker's rebuild leaves it.
"""

import io
import json
import shutil
import threading
import uuid

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from activations.models import ActivationCache
from features import search
from features.models import Explanation, ExplanationJob, Feature, FeatureAnalysis, FeatureLabel
from features.services import feature_label_set
from mistudio.access import OPERATOR
from mistudio.errors import ApplicationError
from mistudio.redis_client import get_redis
from mistudio.workers import run_worker, shared_queue
from models_app.models import LanguageModel
from saes.models import SparseAutoencoder

HOOK = "blocks.0.hook_resid_post"
SHARED_EXPLANATIONS = {
    1: "digits and numerals in code",
    2: "French words in cooking recipes",
    3: "closing parentheses in Python function calls",
}
VOLCANO_WORDS = ["eruptions", "lava", "magma", "ash clouds", "craters", "lava flows", "calderas", "geysers"]


@pytest.fixture(scope="module")
def embedding_model():
    """Loads the model once for the module (the process keeps it: ``search.embedder``)."""
    return search.embedder()


def explanation_job(analysis, owner, *, shared: bool) -> ExplanationJob:
    return ExplanationJob.objects.create(
        analysis=analysis, owner=owner, shared=shared, status="completed",
        explainer_model="tiny-explainer", scorer_model="tiny-scorer",
    )  # fmt: skip


def explain(job, index: int, text: str, **fields) -> Explanation:
    return Explanation.objects.create(
        job=job, analysis=job.analysis, index=index, text=text, explainer_model=job.explainer_model,
        scorer_model=job.scorer_model, prompt_version="test", **fields,
    )  # fmt: skip


@pytest.fixture
def world(embedding_model, writer, reader):
    walt, rita = writer, reader
    model = LanguageModel.objects.create(
        name="search-model", model_type="gpt2", source="huggingface",
        identifier=f"test/{uuid.uuid4().hex[:12]}", owner=walt, shared=True,
    )  # fmt: skip
    cache = ActivationCache.objects.create(
        key_hash=uuid.uuid4().hex, key={}, model=model, hooks=[HOOK], max_length=16, dtype="float32",
        status="completed", num_samples=2, num_tokens=2, owner=walt,
    )  # fmt: skip
    sae = SparseAutoencoder.objects.create(
        model=model, cache=cache, hook_name=HOOK, architecture="topk", d_in=64, d_sae=64, k=8,
        status="completed", owner=walt, shared=True,
    )  # fmt: skip
    analysis = FeatureAnalysis.objects.create(
        sae=sae, cache=cache, status="completed", owner=walt, shared=True, finished_at=timezone.now()
    )
    Feature.objects.bulk_create(
        Feature(
            analysis=analysis, index=index, density=index / 1000, max_activation=1.0, mean_activation=0.5,
            auto_label=f"tok{index}" if index in (1, 7) else "",  # two automatic labels: searched too
        )
        for index in range(64)
    )  # fmt: skip
    shared_job = explanation_job(analysis, walt, shared=True)
    for index, text in SHARED_EXPLANATIONS.items():
        explain(shared_job, index, text, score=0.8 + index / 100, detection=0.9, fuzzing=0.7)
    explain(shared_job, 4, "")  # nothing to search
    explain(shared_job, 5, "names of cities", error_code="EXPLAINER_FAILED")  # failed: not searched
    private_job = explanation_job(analysis, walt, shared=False)
    for offset in range(40):
        word = VOLCANO_WORDS[offset % len(VOLCANO_WORDS)]
        explain(private_job, 10 + offset, f"volcanic {word} in geology texts, variant {offset}")
    FeatureLabel.objects.create(
        sae=sae, index=7, label="legal contracts and court rulings", owner=walt, shared=True
    )
    FeatureLabel.objects.create(sae=sae, index=8, label="volcanoes and lava", owner=walt, shared=False)
    FeatureLabel.objects.create(sae=sae, index=9, label="emoji in chat messages", owner=rita, shared=False)
    assert search.search_index_refresh(analysis) == 3 + 40 + 3 + 2  # what the worker's rebuild does
    return {"walt": walt, "rita": rita, "sae": sae, "analysis": analysis, "shared_job": shared_job}


def counting_embeddings(monkeypatch) -> list[list[str]]:
    """Every call of the process's embedding model from now on, with its texts."""
    calls: list[list[str]] = []
    model = search.embedder()
    original = model.embed
    monkeypatch.setattr(model, "embed", lambda texts: calls.append(list(texts)) or original(texts))
    return calls


def rebuilds_queued(analysis) -> int:
    return sum(
        1
        for job in shared_queue().get_jobs()
        if job.func_name == "features.tasks.rebuild_search_index" and job.args == (analysis.id,)
    )


def find(world, user, query: str, k: int = 10) -> list[dict]:
    return search.feature_search(user=user, sae=world["sae"], analysis=world["analysis"], query=query, k=k)[
        "results"
    ]


def test_a_paraphrase_finds_its_explanation_first_with_its_scores(world):
    found = search.feature_search(
        user=world["rita"], sae=world["sae"], analysis=world["analysis"], query="  numbers and digits ", k=3
    )
    assert found["analysis_id"] == world["analysis"].id and found["query"] == "numbers and digits"
    assert len(found["results"]) == 3
    best = found["results"][0]
    explanation = Explanation.objects.get(job=world["shared_job"], index=1)
    assert best == {
        "index": 1, "cosine": best["cosine"], "source": "explanation", "text": "digits and numerals in code",
        "explanation_id": explanation.id, "score": 0.81, "detection": 0.9, "fuzzing": 0.7,
        "intruder": None, "embedding": None, "simulation": None, "explainer_model": "tiny-explainer",
        "auto_label": "tok1", "density": 0.001,
    }  # fmt: skip
    assert 0.5 < best["cosine"] <= 1.0 and best["cosine"] == round(best["cosine"], 5)
    cosines = [result["cosine"] for result in found["results"]]
    assert cosines == sorted(cosines, reverse=True)


def test_labels_are_found_with_their_feature(world):
    best = find(world, world["rita"], "law and contracts", k=2)[0]
    assert (best["source"], best["index"], best["text"]) == ("label", 7, "legal contracts and court rulings")
    assert best["explanation_id"] is None and best["score"] is None and best["explainer_model"] is None
    assert best["auto_label"] == "tok7"


def test_what_a_user_may_not_see_neither_shows_nor_takes_places(world):
    # rita sees 3 shared explanations, walt's shared label, her own and the analysis's two automatic
    # labels: 7 of the 48 indexed texts.
    everything = find(world, world["rita"], "volcanoes", k=10)
    texts = {result["text"] for result in everything}
    assert len(everything) == 7
    assert texts == {
        *SHARED_EXPLANATIONS.values(),
        "tok1",
        "tok7",
        "legal contracts and court rulings",
        "emoji in chat messages",
    }
    assert not any("volcan" in text for text in texts)
    only = find(world, world["rita"], "lava from volcanoes", k=1)
    assert len(only) == 1 and "volcan" not in only[0]["text"]

    # walt's own private rows are his to find; rita's private label is not his.
    walts = find(world, world["walt"], "volcanoes", k=10)
    assert len(walts) == 10 and all("volcan" in result["text"] for result in walts)
    assert walts[0]["text"] == "volcanoes and lava" or walts[0]["source"] == "explanation"
    assert "emoji in chat messages" not in {
        result["text"] for result in find(world, world["walt"], "emoji", k=50)
    }

    # Shared now: the private job's explanations are rita's to find.
    ExplanationJob.objects.filter(analysis=world["analysis"], shared=False).update(shared=True)
    assert all("volcan" in result["text"] for result in find(world, world["rita"], "volcanoes", k=5))


def test_a_new_explanation_is_found_at_once_and_indexed_by_the_worker(world, monkeypatch):
    analysis = world["analysis"]
    directory = analysis.directory / "search"
    generation = json.loads((directory / "manifest.json").read_text())["generation"]
    names = {path.name for path in directory.iterdir()}
    assert names == {
        ".lock", "embeddings.safetensors", "manifest.json",
        f"index-{generation}.usearch", f"index-{generation}.json", f"items-{generation}.safetensors",
    }  # fmt: skip
    assert "weather" not in find(world, world["rita"], "weather forecasts", k=1)[0]["text"]

    # Found by the query's exact step: embedded with the query, in one call; no index written.
    calls = counting_embeddings(monkeypatch)
    explain(world["shared_job"], 60, "rain and snow in weather reports", score=0.5)
    best = find(world, world["rita"], "weather forecasts", k=1)[0]
    assert (best["index"], best["text"], best["score"]) == (60, "rain and snow in weather reports", 0.5)
    assert calls == [["weather forecasts", "rain and snow in weather reports"]]
    assert json.loads((directory / "manifest.json").read_text())["generation"] == generation

    # The worker's rebuild embeds only the new text; then a query embeds only itself.
    assert search.search_index_refresh(analysis) == 4 + 40 + 3 + 2
    assert calls[1:] == [["rain and snow in weather reports"]]
    assert find(world, world["rita"], "weather forecasts", k=1)[0]["index"] == 60
    assert calls[2:] == [["weather forecasts"]]

    # An edited label is found by its new text at once; a removed one is gone; the worker embeds
    # the edited text once.
    label = FeatureLabel.objects.get(sae=world["sae"], index=7)
    label.label = "rainy weather"
    label.save()
    assert find(world, world["rita"], "weather forecasts", k=2)[1]["text"] == "rainy weather"
    assert search.search_index_refresh(analysis) == 4 + 40 + 3 + 2
    label.delete()
    assert "rainy weather" not in {result["text"] for result in find(world, world["rita"], "weather", k=10)}
    assert search.search_index_refresh(analysis) == 4 + 40 + 2 + 2
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["removed"] == 2 and manifest["generation"] != generation  # updated, not rebuilt
    assert len(list(directory.glob("index-*.usearch"))) == 1  # earlier generations are gone
    assert [text for call in calls for text in call].count("rainy weather") == 2  # the query's, the worker's

    # A job that finishes changes no text: the stamp moves on, the index stays.
    ExplanationJob.objects.filter(pk=world["shared_job"].pk).update(finished_at=timezone.now())
    assert search.search_index_refresh(analysis) == 4 + 40 + 2 + 2
    again = json.loads((directory / "manifest.json").read_text())
    assert again["generation"] == manifest["generation"] and again["stamp"] != manifest["stamp"]


def test_many_label_changes_make_one_rebuild_by_the_worker_and_a_search_rebuilds_nothing(
    world, transactional_db, monkeypatch
):
    """Committed rows (``transactional_db``): the rebuild is queued on commit and run by a real
    burst worker."""
    analysis, walt = world["analysis"], world["walt"]
    directory = analysis.directory / "search"
    generation = json.loads((directory / "manifest.json").read_text())["generation"]
    feature_label_set(
        sae=world["sae"], index=20, actor=walt, label="submarines and naval warfare", shared=True
    )
    for index in range(21, 60):
        feature_label_set(
            sae=world["sae"], index=index, actor=walt, label=f"tokens of group {index}", shared=True
        )
    feature_label_set(sae=world["sae"], index=60, actor=walt, label="ancient Roman aqueducts", shared=True)
    assert rebuilds_queued(analysis) == 1  # 41 changes, one rebuild

    # A search meanwhile: the last index and the freshest labels, embedded with the query in one
    # call; it writes no index and queues nothing more.
    monkeypatch.setattr(search, "_write_index", lambda *args: pytest.fail("a search wrote the index"))
    calls = counting_embeddings(monkeypatch)
    assert find(world, world["rita"], "Roman aqueducts", k=1)[0]["text"] == "ancient Roman aqueducts"
    assert len(calls) == 1 and len(calls[0]) == 1 + search.FRESH_TEXTS
    assert "submarines" not in {result["text"] for result in find(world, world["rita"], "submarines", k=3)}
    assert rebuilds_queued(analysis) == 1
    assert json.loads((directory / "manifest.json").read_text())["generation"] == generation

    # The worker's rebuild: every label findable, each embedded once, by the worker.
    monkeypatch.undo()
    calls = counting_embeddings(monkeypatch)
    run_worker(name="search-worker", device="cpu", burst=True)
    assert rebuilds_queued(analysis) == 0 and not get_redis().exists(search.rebuild_pending_key(analysis.id))
    assert json.loads((directory / "manifest.json").read_text())["count"] == 3 + 40 + 3 + 41 + 2
    assert sorted(text for call in calls for text in call) == sorted(
        ["submarines and naval warfare", "ancient Roman aqueducts"]
        + [f"tokens of group {i}" for i in range(21, 60)]
    )
    best = find(world, world["rita"], "submarines", k=1)[0]
    assert (best["source"], best["index"], best["text"]) == ("label", 20, "submarines and naval warfare")


def test_an_index_on_disk_is_used_by_a_fresh_process(world, monkeypatch):
    search.search_index_refresh(world["analysis"])
    monkeypatch.setattr(search, "_loaded", type(search._loaded)())  # as a new process would start
    monkeypatch.setattr(search, "_write_index", lambda *args: pytest.fail("rewrote an index that was fresh"))
    assert find(world, world["rita"], "numbers and digits", k=1)[0]["index"] == 1


def test_two_refreshes_of_a_missing_index_build_it_once(world, transactional_db, monkeypatch):
    """Committed rows (``transactional_db``), each thread on its own database connection."""
    shutil.rmtree(world["analysis"].directory / "search")
    search._loaded.clear()
    model = search.embedder()
    embedded: list[str] = []
    original = model.embed
    monkeypatch.setattr(model, "embed", lambda texts: embedded.extend(texts) or original(texts))
    start, counts = threading.Barrier(2), []

    def refresh():
        try:
            start.wait()
            counts.append(search.search_index_refresh(world["analysis"]))
        finally:
            connection.close()

    threads = [threading.Thread(target=refresh) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counts == [3 + 40 + 3 + 2] * 2
    assert len(embedded) == len(set(embedded)) == 3 + 40 + 3 + 2  # every text once, by one of them
    assert len(list((world["analysis"].directory / "search").glob("index-*.usearch"))) == 1


def test_damaged_files_are_rebuilt_by_the_worker_and_an_analysis_without_texts_finds_nothing(
    world, transactional_db
):
    directory = world["analysis"].directory / "search"
    for path in directory.iterdir():
        if path.suffix in (".safetensors", ".usearch", ".json"):
            path.write_bytes(b"damaged")
    search._loaded.clear()
    with pytest.raises(ApplicationError) as building:  # 46 texts: more than a query embeds itself
        find(world, world["rita"], "numbers and digits", k=1)
    assert (building.value.code, building.value.status) == ("SEARCH_INDEX_BUILDING", 503)
    assert building.value.details["retry_after_seconds"] == search.BUILDING_RETRY_SECONDS
    run_worker(name="search-worker", device="cpu", burst=True)
    assert find(world, world["rita"], "numbers and digits", k=1)[0]["index"] == 1

    empty = FeatureAnalysis.objects.create(
        sae=world["sae"], status="completed", owner=world["walt"], shared=True, finished_at=timezone.now()
    )
    FeatureLabel.objects.filter(sae=world["sae"]).delete()
    found = search.feature_search(user=world["rita"], sae=world["sae"], analysis=empty, query="numbers", k=5)
    assert found == {"analysis_id": empty.id, "query": "numbers", "results": []}
    assert search.search_index_refresh(empty) == 0


def test_an_analysis_of_a_few_texts_is_searched_before_its_index_is_built(world):
    """At most FRESH_TEXTS texts and no index yet: the query's exact step finds them all."""
    few = FeatureAnalysis.objects.create(
        sae=world["sae"], status="completed", owner=world["walt"], shared=True, finished_at=timezone.now()
    )
    explain(
        explanation_job(few, world["walt"], shared=True), 3, "closing parentheses in Python function calls"
    )
    found = search.feature_search(
        user=world["rita"], sae=world["sae"], analysis=few, query="brackets in code", k=3
    )
    texts = [result["text"] for result in found["results"]]
    assert texts[0] == "closing parentheses in Python function calls"
    assert set(texts) == {texts[0], "legal contracts and court rulings", "emoji in chat messages"}
    assert not (few.directory / "search" / "manifest.json").exists()


def test_an_empty_query_and_a_missing_model_are_refused(world, settings, tmp_path):
    with pytest.raises(ApplicationError) as empty:
        find(world, world["rita"], "   ")
    assert (empty.value.code, empty.value.status) == ("INVALID_QUERY", 400)

    settings.EMBEDDING_MODEL_DIR = tmp_path / "no-model-here"
    with pytest.raises(ApplicationError) as missing:
        find(world, world["rita"], "numbers")
    assert (missing.value.code, missing.value.status) == ("EMBEDDING_MODEL_MISSING", 503)
    assert "EMBEDDING_MODEL_DIR" in missing.value.message


def test_the_api_route(world, client_for):
    url = f"/api/saes/{world['sae'].id}/features/search"
    response = client_for(world["rita"]).get(url, {"q": "numbers and digits", "k": 2})
    assert response.status_code == 200, response.content
    body = response.json()
    assert set(body) == {"analysis_id", "query", "results"} and len(body["results"]) == 2
    assert body["results"][0]["text"] == "digits and numerals in code"
    assert set(body["results"][0]) == {
        "index", "cosine", "source", "text", "explanation_id", "score", "detection", "fuzzing", "intruder",
        "embedding", "simulation", "explainer_model", "auto_label", "density",
    }  # fmt: skip

    response = client_for(world["rita"]).get(url, {"q": "numbers", "analysis": world["analysis"].id})
    assert response.status_code == 200 and response.json()["analysis_id"] == world["analysis"].id
    assert client_for(world["rita"]).get(url, {"q": ""}).status_code == 400
    assert client_for(world["rita"]).get(url, {"q": "   "}).status_code == 400
    assert APIClient().get(url, {"q": "numbers"}).status_code in (401, 403)


def test_the_command_prints_a_table(world):
    out = io.StringIO()
    call_command("search_features", world["sae"].id, "numbers and digits", "--k", "3", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("3 results for 'numbers and digits'")
    assert lines[1].split() == ["rank", "feature", "cosine", "score", "source", "text"]
    assert lines[2].split()[:2] == ["1", "1"] and lines[2].endswith("digits and numerals in code")
    # The operator sees every row, private ones included.
    out = io.StringIO()
    call_command(
        "search_features", world["sae"].id, "volcanoes", "--analysis", world["analysis"].id, stdout=out
    )
    assert "volcan" in out.getvalue()
    assert (
        search.feature_search(
            user=OPERATOR, sae=world["sae"], analysis=world["analysis"], query="emoji", k=1
        )["results"][0]["text"]
        == "emoji in chat messages"
    )


def test_automatic_labels_are_searched_by_meaning_and_marked_as_such(world):
    """Before: every feature has an automatic label, and search by meaning said "No explanation or
    label yet" until someone explained or labelled one."""
    # Feature rows are written whole by their analysis (replaced, never edited in place).
    Feature.objects.filter(analysis=world["analysis"], index=33).delete()
    Feature.objects.create(
        analysis=world["analysis"], index=33, density=0.033, max_activation=1.0, mean_activation=0.5,
        auto_label="lava eruption volcano",
    )  # fmt: skip
    assert search.search_index_refresh(world["analysis"]) == 3 + 40 + 3 + 3
    best = find(world, world["rita"], "volcanic eruptions", k=1)[0]
    assert (best["source"], best["index"], best["text"]) == ("auto_label", 33, "lava eruption volcano")
    assert best["auto_label"] == "lava eruption volcano" and best["explanation_id"] is None
