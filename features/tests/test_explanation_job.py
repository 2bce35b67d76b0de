"""Explanation jobs through the whole stack: API → queue → a real worker → this workbench's own
/v1 (a live Daphne and worker serving a real tiny Llama) → Explanation rows → dashboards, the
feature list, accept as label, export.

The tiny model's explanations are poor; what is checked is the plumbing: the prompts hold the
feature's own examples with its activating tokens marked, the held-out samples are the ones the
explainer never saw, non-activating contexts really are zero for the feature, every scorer
answer is accounted for, and the scores are the balanced accuracy of the recorded counts.
"""

import io
import json

import numpy as np
import pytest
import torch
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command

from engine.autointerp.pipeline import InterpretationConfig
from engine.autointerp.prompts import PROMPT_VERSION
from engine.sae.formats import load_saelens
from features.explanation_tasks import feature_examples, non_activating_examples
from features.models import Explanation, ExplanationJob, Feature, FeatureAnalysis
from features.selectors import FeatureFile, analysis_tokenizer
from features.services import analysis_request
from features.tests.conftest import completed_sae_row
from generation.models import Generation
from models_app.models import LanguageModel
from models_app.tests.live_stack import wait_until
from saes.tests.conftest import HOOK, write_planted_cache

pytestmark = pytest.mark.django_db(transaction=True)

OPTIONS = {"concurrency": 4, "explain_max_tokens": 24, "score_max_tokens": 16, "test_examples": 6}


def finished(row, timeout: float = 300.0):
    """The row once the live worker has ended it (it takes jobs from the shared queue and the
    queue of the model it hosts)."""

    def ended():
        row.refresh_from_db()
        return row.status not in ("queued", "running")

    wait_until(ended, timeout=timeout, what=f"{row.pk} to end")
    return row


@pytest.fixture
def analysed(live_stack):
    """A completed analysis of a random SAE over a planted cache, owned by the live stack's user."""
    user = get_user_model().objects.get(username="live-writer")
    model = LanguageModel.objects.get(pk=live_stack.models["gpt2"])
    cache = write_planted_cache(model, user, samples=64)
    sae = completed_sae_row(model, cache, user)
    analysis = finished(analysis_request(owner=user, sae=sae))
    assert analysis.status == FeatureAnalysis.Status.COMPLETED, analysis.error_message
    return user, sae, analysis


def test_explain_score_show_accept_export(live_stack, analysed, client_for):
    user, sae, analysis = analysed
    api = client_for(user)
    explainer = live_stack.models["llama"]  # a 4,096-token context: the full prompts fit
    # The sparsest live features: the cache has contexts where they are quiet (the densest have none).
    sparse = Feature.objects.filter(analysis=analysis, density__gt=0).order_by("density", "index")[:6]
    selection = {"kind": "list", "indices": [feature.index for feature in sparse]}
    body = {"explainer_model": explainer, "selection": selection, "options": OPTIONS}

    estimate = api.post(f"/api/saes/{sae.id}/explanations", {**body, "dry_run": True}, format="json")
    assert estimate.status_code == 200, estimate.content
    config = InterpretationConfig(**{**OPTIONS})
    assert estimate.json()["estimate"]["requests"] == 6 * config.requests_per_feature()
    assert estimate.json()["estimate"]["prompt_tokens"] > 0
    assert not ExplanationJob.objects.exists()  # a dry run writes nothing

    started = api.post(f"/api/saes/{sae.id}/explanations", body, format="json")
    assert started.status_code == 202, started.content
    job = finished(ExplanationJob.objects.get(pk=started.json()["id"]))
    assert job.status == "completed", (job.error_code, job.error_message)
    assert job.features_done == 6 and job.progress == 100 and job.features_per_minute > 0
    state = api.get(f"/api/saes/{sae.id}/explanations/{job.id}").json()
    assert state["completed_with_failures"] == (job.features_failed > 0)

    rows = {row.index: row for row in Explanation.objects.filter(job=job)}
    assert sorted(rows) == sorted(job.indices)
    # Every request really went through /v1 as the job's owner (and none was refused).
    sent = Generation.objects.filter(owner=user, interface=Generation.Interface.OPENAI_CHAT)
    assert sent.count() == job.requests_sent > 0, [(r.error_code, r.error_message) for r in rows.values()]
    assert not sent.exclude(status="completed").exists()

    data = FeatureFile(analysis)
    tokenizer = analysis_tokenizer(sae)
    quiet = non_activating_examples(analysis, job.indices, config, tokenizer=tokenizer, device="cpu")
    for index, row in rows.items():
        assert row.prompt_version == PROMPT_VERSION and row.explainer_model == explainer
        examples = feature_examples(data, index, config, tokenizer, quiet[index])
        # The explainer saw the feature's own examples, with activating tokens marked.
        content = "\n".join(message["content"] for message in row.prompt)
        assert "<<" in content and ">>" in content
        plain = content.replace("<<", "").replace(">>", "")
        assert all(example.text in plain for example in examples.train)
        if row.error_code:
            assert row.error_code in {"NO_EXPLANATION", "PROMPT_TOO_LONG", "ENDPOINT_ERROR"}
            continue
        assert row.text
        for kind in ("detection", "fuzzing"):
            if not examples.test:  # a feature with a single example: nothing held out, nothing scored
                assert kind not in row.scoring
                continue
            counts = row.scoring[kind]
            assert counts["total"] == len(examples.test) + len(examples.non_activating) > 0
            valid = counts["total"] - counts["failed"]
            assert valid == sum(
                counts[name]
                for name in ("true_positives", "true_negatives", "false_positives", "false_negatives")
            )
            positives = counts["true_positives"] + counts["false_negatives"]
            negatives = counts["true_negatives"] + counts["false_positives"]
            expected = (
                None
                if valid == 0
                else (
                    (counts["true_positives"] / positives if positives else 0)
                    + (counts["true_negatives"] / negatives if negatives else 0)
                )
                / 2
            )
            assert (
                getattr(row, kind) == pytest.approx(expected)
                if expected is not None
                else getattr(row, kind) is None
            )
        present = [value for value in (row.detection, row.fuzzing) if value is not None]
        assert row.score == (pytest.approx(sum(present) / len(present)) if present else None)

    # The dashboards show them, the list sorts by them, one becomes the label.
    explained = next(row for row in rows.values() if not row.error_code)
    detail = api.get(f"/api/saes/{sae.id}/features/{explained.index}").json()
    assert detail["explanations"][0]["text"] == explained.text
    assert detail["explanations"][0]["prompt"] == explained.prompt
    listing = api.get(f"/api/saes/{sae.id}/features", {"explained": "true", "sort": "-score"}).json()
    assert {entry["index"] for entry in listing["features"]} == {
        i for i, r in rows.items() if r.score is not None
    }
    accepted = api.post(
        f"/api/saes/{sae.id}/features/{explained.index}/explanations/{explained.pk}/accept", {}, format="json"
    )
    assert accepted.status_code == 200 and accepted.json()["label"]["label"] == explained.text[:200]
    wrong_feature = api.post(
        f"/api/saes/{sae.id}/features/{explained.index + 1}/explanations/{explained.pk}/accept",
        {},
        format="json",
    )
    assert wrong_feature.status_code == 404
    export = json.loads(b"".join(api.get(f"/api/saes/{sae.id}/features/export").streaming_content))
    entry = export["features"][explained.index]
    assert entry["explanations"][0] == {"description": explained.text[:200], "typeName": "label"}
    assert entry["explanations"][1]["description"] == explained.text
    assert entry["explanations"][1]["score"] == explained.score


def _simulated(model, tokenizer, examples, explanation: str) -> float | None:
    """The simulation score computed apart from the job: each example's simulation prompt rendered
    as the workbench renders chat, one transformers forward, the top 15 logprobs at each position,
    and delphi's parser and correlation (themselves checked against delphi's)."""
    from engine.autointerp.scoring import quantiles
    from engine.autointerp.simulation import (
        correlation,
        predicted_values,
        simulation_messages,
        simulation_records,
    )
    from engine.generation import render_prompt

    records = simulation_records(
        quantiles(examples.test, InterpretationConfig().per_prompt), examples.non_activating
    )
    truth, predicted = [], []
    for record in records:
        ids = render_prompt(tokenizer, messages=simulation_messages(explanation, record.tokens))
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        entries: list[dict | None] = [None]
        for position in range(1, len(ids)):
            values, indices = logprobs[position - 1].topk(15)
            entry = {str(ids[position]): {"logprob": logprobs[position - 1, ids[position]].item(),
                                          "decoded_token": tokenizer.decode([ids[position]])}}  # fmt: skip
            for token_id, value in zip(indices.tolist(), values.tolist(), strict=True):
                entry.setdefault(
                    str(token_id), {"logprob": value, "decoded_token": tokenizer.decode([token_id])}
                )
            entries.append(entry)
        truth += [float(value) for value in record.values]
        predicted += predicted_values(ids, entries, len(record.tokens))
    return correlation(truth, predicted)


def test_the_intruder_embedding_and_simulation_scorers_through_a_job(
    live_stack, analysed, client_for, tiny_llama_folder
):
    """The opt-in scorers: the intruder scorer asks the workbench's own model one question per
    non-activating example; the embedding scorer asks none, and its score is the AUC of MiniLM's
    similarities of the explanation to the feature's examples against the others; the simulation
    scorer asks /v1 for each example's prompt logprobs: every example gets a prediction for each of
    its tokens, and the correlation is the one a forward pass of the same model gives (the random
    model predicts the same value everywhere, so it is undefined, None, here; the arithmetic is
    checked against delphi's in engine/tests/test_autointerp_delphi.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.autointerp.prompts import EMBEDDING_QUERY
    from engine.autointerp.scoring import detection_samples, embedding_auc
    from features.search import embedder

    user, sae, analysis = analysed
    api = client_for(user)
    options = {**OPTIONS, "non_activating": 4, "scorers": ["intruder", "embedding", "simulation"]}
    config = InterpretationConfig(**options)
    # The explanation, one request per intruder prompt, one per simulated example.
    assert config.requests_per_feature() == 1 + 4 + (6 + 4)
    # Two features with held-out examples and quiet contexts: both scorers have something to score.
    data, tokenizer = FeatureFile(analysis), analysis_tokenizer(sae)
    candidates = [feature.index for feature in Feature.objects.filter(analysis=analysis, density__gt=0)]
    quiet = non_activating_examples(analysis, candidates, config, tokenizer=tokenizer, device="cpu")
    chosen = [
        index
        for index in candidates
        if quiet[index] and feature_examples(data, index, config, tokenizer, quiet[index]).test
    ][:2]
    assert len(chosen) == 2
    body = {"explainer_model": live_stack.models["llama"], "options": options,
            "selection": {"kind": "list", "indices": chosen}}  # fmt: skip
    started = api.post(f"/api/saes/{sae.id}/explanations", body, format="json")
    assert started.status_code == 202, started.content
    job = finished(ExplanationJob.objects.get(pk=started.json()["id"]))
    assert job.status == "completed", (job.error_code, job.error_message)
    rows = [row for row in Explanation.objects.filter(job=job) if not row.error_code]
    assert rows, "no feature was explained"
    scorer_model = AutoModelForCausalLM.from_pretrained(tiny_llama_folder)  # the explainer is the scorer
    scorer_tokenizer = AutoTokenizer.from_pretrained(tiny_llama_folder)
    scored = 0
    for row in rows:
        examples = feature_examples(data, row.index, config, tokenizer, quiet[row.index])
        if not examples.test or not examples.non_activating:  # nothing held out, or no quiet context
            assert "intruder" not in row.scoring, (len(examples.test), len(examples.non_activating))
            continue
        scored += 1
        intruder = row.scoring["intruder"]
        assert intruder["total"] == len(examples.non_activating) and intruder["metric"] == "accuracy"
        assert row.intruder == pytest.approx(intruder["true_positives"] / intruder["total"])
        samples = detection_samples(examples.test, examples.non_activating)
        similarities = embedder().similarities(
            EMBEDDING_QUERY + row.text, [sample.text for sample in samples]
        )
        expected = embedding_auc([sample.activating for sample in samples], similarities)
        assert (
            row.embedding == pytest.approx(expected, abs=1e-6) and row.scoring["embedding"]["metric"] == "auc"
        )
        assert row.detection is None and row.score is None  # no classifier ran: no balanced accuracy
        simulation = row.scoring["simulation"]
        assert simulation["metric"] == "correlation" and simulation["failed"] == 0
        assert simulation["total"] == len(examples.test) + len(examples.non_activating)
        expected = _simulated(scorer_model, scorer_tokenizer, examples, row.text)
        assert (row.simulation is None) == (expected is None)
        if expected is not None:
            assert row.simulation == pytest.approx(expected, abs=1e-4)
    assert scored > 0
    shown = api.get(f"/api/saes/{sae.id}/explanations/{job.id}/results").json()
    assert {"intruder", "embedding", "simulation"} <= set(shown["explanations"][0])


def test_held_out_and_non_activating_examples(analysed):
    """The scorers' activating examples are ones the explainer did not see; the non-activating
    contexts are zero for the feature on every token (checked by encoding them again)."""
    _, sae, analysis = analysed
    config = InterpretationConfig(test_examples=8, non_activating=6)
    data = FeatureFile(analysis)
    density = data.rows("density", 0, sae.d_sae)
    indices = [int(index) for index in np.argsort(np.where(density > 0, density, 2), kind="stable")[:10]]
    quiet = non_activating_examples(analysis, indices, config, tokenizer=None, device="cpu")
    module, _ = load_saelens(sae.directory)
    from saes.tasks import open_cache

    store = open_cache(analysis.cache, HOOK)
    table = store.tokens()
    ids = np.asarray(table["token_ids"])
    acts = module.encode(torch.from_numpy(np.asarray(store.get(HOOK))).float()).detach().numpy()
    for index in indices:
        assert len(quiet[index]) == config.non_activating
        for example in quiet[index]:
            # Find the window in the cache (ids shown as "#id" without a tokenizer) and re-encode it.
            window = [int(token[1:]) for token in example.tokens]
            starts = [
                s for s in range(len(ids) - len(window) + 1) if list(ids[s : s + len(window)]) == window
            ]
            # (The planted ids repeat every 1,000 rows: the window is one of the places it occurs.)
            assert any(acts[s : s + len(window), index].max() == 0 for s in starts)
        examples = feature_examples(data, index, config, None, quiet[index])
        shown = {example.tokens for example in examples.train}
        assert len(examples.test) >= (len(examples.train) > 1)  # one example: shown, none held out
        # The top examples the explainer did not see are held out too (a rare feature has few).
        top_count = int((data.row("top_rows", index) >= 0).sum())
        assert len(examples.test) >= min(config.test_examples, top_count - len(examples.train))
        assert not any(example.tokens in shown for example in examples.test)
        assert all(example.activating for example in examples.test)


def test_bad_requests(live_stack, analysed, client_for, reader):
    user, sae, _ = analysed
    api = client_for(user)
    base = f"/api/saes/{sae.id}/explanations"
    explainer = live_stack.models["llama"]
    cases = [
        ({"explainer_model": "no-such-model"}, 404, "MODEL_NOT_FOUND"),
        ({"explainer_model": explainer, "endpoint": "nowhere"}, 404, "ENDPOINT_NOT_FOUND"),
        (
            {"explainer_model": explainer, "selection": {"kind": "list", "indices": [10**6]}},
            400,
            "FEATURE_NOT_FOUND",
        ),
        (
            {"explainer_model": explainer, "selection": {"kind": "density", "min": 0.5, "max": 0.1}},
            400,
            "INVALID_SELECTION",
        ),
        ({"explainer_model": explainer, "options": {"per_prompt": 0}}, 400, "VALIDATION_ERROR"),
    ]
    for body, status, code in cases:
        response = api.post(base, body, format="json")
        assert response.status_code == status and response.json()["error"]["code"] == code, response.content
    assert not ExplanationJob.objects.exists()
    # A reader sees the SAE only if shared; either way may not start jobs.
    assert client_for(reader).post(base, {"explainer_model": explainer}, format="json").status_code in (
        403,
        404,
    )

    # Cancel while queued: nothing runs.
    job = api.post(
        base, {"explainer_model": explainer, "selection": {"kind": "top", "count": 2}}, format="json"
    ).json()
    cancelled = api.post(f"{base}/{job['id']}/cancel", {}, format="json")
    assert cancelled.status_code == 200
    assert finished(ExplanationJob.objects.get(pk=job["id"])).status == "cancelled"


def test_the_command_estimates_runs_and_prints_the_scores(live_stack, analysed):
    user, sae, analysis = analysed
    explainer = live_stack.models["llama"]
    sparse = Feature.objects.filter(analysis=analysis, density__gt=0).order_by("density", "index")[:2]
    arguments = [sae.id, "--model", explainer, "--indices", *(str(f.index) for f in sparse)]
    out = io.StringIO()
    call_command("explain_features", *arguments, "--owner", user.username, "--estimate", stdout=out)
    assert "2 features: 18 requests" in out.getvalue() and not ExplanationJob.objects.exists()
    with pytest.raises(CommandError, match="OWNER_REQUIRED"):  # /v1 serves users, not the operator
        call_command("explain_features", *arguments, stdout=io.StringIO())
    out = io.StringIO()
    call_command(
        "explain_features",
        *arguments,
        "--owner",
        user.username,
        "--scorers",
        "detection",
        stdout=out,
        stderr=out,
    )
    job = ExplanationJob.objects.get()
    assert job.status == "completed" and f"Explanation job {job.id} completed" in out.getvalue()
    assert job.config["scorers"] == ["detection"] and job.explanations.count() == 2


def test_a_resumed_job_explains_only_what_is_left(live_stack, analysed):
    """A worker that died mid-job leaves some features explained: the job run again (as a worker
    does at start) keeps them and sends requests for the others only."""
    from django.test import override_settings

    from mistudio.workers import run_worker

    user, _, analysis = analysed
    explainer = live_stack.models["llama"]
    sparse = [
        f.index for f in Feature.objects.filter(analysis=analysis, density__gt=0).order_by("density")[:4]
    ]
    job = queued_job(
        analysis, user, explainer, sparse, {"scorers": ["detection"], **OPTIONS}, "resuming-worker"
    )
    ExplanationJob.objects.filter(pk=job.pk).update(requests_sent=7)  # what the first run had sent
    before = [
        Explanation.objects.create(
            job=job,
            analysis=analysis,
            index=index,
            text=f"kept {index}",
            explainer_model=explainer,
            scorer_model=explainer,
            prompt_version=PROMPT_VERSION,
        )
        for index in sparse[:2]
    ]
    with override_settings(MISTUDIO_API_URL=live_stack.base_url):
        run_worker(name="resuming-worker", device="cpu", burst=True)
    job.refresh_from_db()
    assert job.status == "completed" and job.features_done == 4, (job.error_code, job.error_message)
    assert [Explanation.objects.get(pk=row.pk).text for row in before] == [f"kept {i}" for i in sparse[:2]]
    assert job.explanations.count() == 4
    sent = Generation.objects.filter(owner=user, interface=Generation.Interface.OPENAI_CHAT).count()
    assert job.requests_sent == 7 + sent  # the earlier run's count, then this run's requests


def queued_job(
    analysis, user, explainer: str, indices: list[int], options: dict, worker: str, context_tokens: int = 4096
) -> ExplanationJob:
    """A job as ``explanation_request`` writes it, on ``worker``'s own queue (run in this process)."""
    from features.explanations import interpretation_config
    from mistudio.jobs import job_submit
    from mistudio.workers import worker_queue

    config = interpretation_config(analysis, options)
    job = ExplanationJob.objects.create(
        analysis=analysis, explainer_model=explainer, scorer_model=explainer, indices=indices, owner=user,
        config={**config.__dict__, "context_tokens": context_tokens},
    )  # fmt: skip
    job_submit(job, queue=worker_queue(worker))
    return job


def test_a_job_that_explains_no_feature_fails_and_says_why(live_stack, analysed):
    """Before: every feature failed and the job still ended a green "completed". A job that got
    past the preflight (its context set as an older job's might be) fails with what went wrong."""
    from mistudio.workers import run_worker

    user, _, analysis = analysed
    live = [f.index for f in Feature.objects.filter(analysis=analysis, density__gt=0)][:3]
    job = queued_job(analysis, user, live_stack.models["llama"], live, {}, "narrow-worker", context_tokens=64)
    run_worker(name="narrow-worker", device="cpu", burst=True)
    job.refresh_from_db()
    assert job.status == "failed" and job.error_code == "NO_FEATURE_EXPLAINED"
    assert job.error_message.startswith("None of the 3 features was explained (3 PROMPT_TOO_LONG)")
    assert "longer context" in job.error_message
    assert job.summary["explained"] == 0 and job.summary["failures"] == {"PROMPT_TOO_LONG": 3}


def test_an_endpoint_that_does_not_answer_fails_the_job_early(live_stack, analysed):
    """A wrong MISTUDIO_API_URL (nothing listens there): the first features all fail on it, and the
    job fails with that code rather than trying every feature."""
    from django.test import override_settings

    from mistudio.workers import run_worker
    from models_app.tests.live_stack import free_port

    user, _, analysis = analysed
    live = [f.index for f in Feature.objects.filter(analysis=analysis, density__gt=0)]
    job = queued_job(analysis, user, live_stack.models["llama"], live, {"concurrency": 8}, "lost-worker")
    with override_settings(MISTUDIO_API_URL=f"http://127.0.0.1:{free_port()}"):
        run_worker(name="lost-worker", device="cpu", burst=True)
    job.refresh_from_db()
    assert job.status == "failed" and job.error_code == "ENDPOINT_UNREACHABLE", job.error_message
    assert job.features_done < len(live)


def test_an_external_endpoint_with_its_key_in_the_environment(
    live_stack, analysed, client_for, monkeypatch, caplog
):
    """An administrator's endpoint (here: the live stack's /v1 reached as an outside server would,
    with an API key) is used with the key read from its variable, and the key is nowhere else: not
    in the job's row or its explanations, not in any answer of the API, not in the log."""
    import logging

    from django.forms.models import model_to_dict
    from django.test import override_settings

    from mistudio.workers import run_worker

    user, sae, analysis = analysed
    key = live_stack.token  # the live user's API token: the endpoint's key
    monkeypatch.setenv("OUTSIDE_EXPLAINER_KEY", key)
    endpoints = {
        "outside": {
            "url": f"{live_stack.base_url}/v1",
            "key_env": "OUTSIDE_EXPLAINER_KEY",
            "context_tokens": 4096,
        }
    }
    api = client_for(user)
    sparse = [
        f.index for f in Feature.objects.filter(analysis=analysis, density__gt=0).order_by("density")[:2]
    ]
    caplog.set_level(logging.DEBUG)
    with override_settings(EXPLAINER_ENDPOINTS=endpoints):
        listed = api.get("/api/explainers").json()
        assert {"name": "outside", "url": f"{live_stack.base_url}/v1", "kind": "external", "has_key": True,
                "context_tokens": 4096} in listed["endpoints"]  # fmt: skip
        body = {
            "endpoint": "outside", "explainer_model": live_stack.models["llama"],
            "selection": {"kind": "list", "indices": sparse},
            "options": {**OPTIONS, "scorers": ["detection"]},
        }  # fmt: skip
        estimate = api.post(f"/api/saes/{sae.id}/explanations", {**body, "dry_run": True}, format="json")
        assert estimate.status_code == 200, estimate.content
        # Run here, where the endpoint is configured (the live worker, which takes the shared queue's
        # jobs, was started without it).
        job = queued_job(analysis, user, body["explainer_model"], sparse, body["options"], "outside-worker")
        ExplanationJob.objects.filter(pk=job.pk).update(endpoint="outside")
        run_worker(name="outside-worker", device="cpu", burst=True)
    job = finished(job)
    assert job.status == "completed", (job.error_code, job.error_message)
    assert job.explanations.count() == 2 and job.requests_sent > 0
    # Every request reached the endpoint with the key: the generations are the key's user's.
    assert Generation.objects.filter(owner=user).count() == job.requests_sent
    seen = [
        json.dumps(model_to_dict(job), default=str),
        *(json.dumps(model_to_dict(row), default=str) for row in job.explanations.all()),
        api.get(f"/api/saes/{sae.id}/explanations/{job.id}").content.decode(),
        api.get(f"/api/saes/{sae.id}/explanations/{job.id}/results", {"prompt": "true"}).content.decode(),
        caplog.text,
    ]
    assert not any(key in text for text in seen)
