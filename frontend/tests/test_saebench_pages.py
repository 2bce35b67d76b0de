"""The comparison page as the server renders it: a group's members with every method's newest
numbers, sorted by any column from its header, frontier plots, each result's SAEBench JSON; the
form (defaults from the service) queues a run with the same service as the API, errors shown in the
form; a run's page follows it live; others see only what they may."""

import re

import pytest
from django.test import Client

from activations.services.datasets import dataset_create_from_texts
from conftest import make_user
from engine.saebench.results import CoreConfig
from evaluations.models import BenchResult, BenchRun
from models_app.services import model_register
from saes.models import SaeGroup, SparseAutoencoder

pytestmark = pytest.mark.django_db
HOOK = "blocks.1.hook_resid_post"


def signed_in(user) -> Client:
    browser = Client()
    browser.force_login(user)
    return browser


@pytest.fixture
def judged(tiny_gpt2_folder, writer):
    """A group of three SAEs, two judged by a completed run (core, and sparse probing for one)."""
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=writer)
    dataset = dataset_create_from_texts(
        name="texts", texts=["one two", "three four"], owner=writer, source="upload"
    )
    group = SaeGroup.objects.create(model=model, dataset=dataset, status="completed", owner=writer, name="g")
    saes = [
        SparseAutoencoder.objects.create(
            name=f"member {index}",
            model=model,
            group=group,
            group_index=index,
            hook_name=HOOK,
            architecture="topk",
            d_in=64,
            d_sae=256,
            k=8,
            status="completed",
            owner=writer,
        )
        for index in range(3)
    ]
    run = BenchRun.objects.create(
        model=model, group=group, saes=[sae.id for sae in saes], methods=["core"], dataset=dataset,
        status="completed", owner=writer,
    )  # fmt: skip
    for sae, l0, score in ((saes[0], 12.0, 0.91), (saes[1], 40.0, 0.97)):
        BenchResult.objects.create(
            run=run, sae=sae, method="core", method_version="sae-bench 0.6.0 core",
            metrics={"sparsity": {"l0": l0, "l1": 3.0},
                     "model_performance_preservation": {"ce_loss_score": score},
                     "reconstruction_quality": {"explained_variance": score - 0.1, "cossim": 0.9}},
        )  # fmt: skip
    BenchResult.objects.create(
        run=run, sae=saes[0], method="sparse_probing", method_version="sae-bench 0.6.0 sparse_probing",
        metrics={"sae": {"sae_top_1_test_accuracy": 0.8}, "llm": {"llm_top_1_test_accuracy": 0.75}},
    )  # fmt: skip
    return group, saes, run, dataset


def test_a_groups_members_sort_by_any_column_with_plots_and_exports(judged, writer):
    group, saes, run, _ = judged
    browser = signed_in(writer)
    page = browser.get(f"/saes/compare/?group={group.id}").content.decode()
    order = re.findall(r'<tr data-sae-id="(sae_\w+)"', page)
    assert order == [saes[1].id, saes[0].id, saes[2].id]  # by L0, highest first; the unjudged last
    assert (
        'data-chart="core.ce_loss_score"' in page
        and 'data-chart="sparse_probing.sae_top_1_test_accuracy"' in page
    )
    assert f"/api/saebench/{run.id}/export?sae_id={saes[0].id}&amp;method=core" in page
    assert 'data-metric="sparse_probing.sae_top_1_test_accuracy">0.8000' in page
    # The header link sorts by CE loss score, best first; a second click flips it.
    link = re.search(r'href="(\?[^"]*sort=core.ce_loss_score[^"]*)"', page)[1].replace("&amp;", "&")
    sorted_page = browser.get(f"/saes/compare/{link}").content.decode()
    assert re.findall(r'<tr data-sae-id="(sae_\w+)"', sorted_page)[:2] == [saes[1].id, saes[0].id]
    flipped = browser.get(
        f"/saes/compare/?group={group.id}&sort=core.ce_loss_score&order=asc"
    ).content.decode()
    assert re.findall(r'<tr data-sae-id="(sae_\w+)"', flipped)[:2] == [saes[0].id, saes[1].id]
    # The form's defaults are the service's (SAEBench's).
    assert (
        f'name="batch_size_prompts" type="number" min="1" value="{CoreConfig().batch_size_prompts}"' in page
    )
    # Absorption is opt-in, with its cost shown before it is chosen.
    estimate = re.search(r'id="bench-absorption-estimate">\(([^)]*)\)', page)[1]
    assert re.fullmatch(
        r"first-letter tasks from the model's \d+ words of letters: \d+ prompts, about \d+ s", estimate
    )
    assert 'name="method_absorption" id="bench-absorption">' in page  # not checked
    group_page = browser.get(f"/saes/groups/{group.id}/").content.decode()
    assert f"/saes/compare/?group={group.id}" in group_page


def test_the_form_queues_a_run_through_the_service_and_shows_its_errors(judged, writer):
    group, saes, _, dataset = judged
    browser = signed_in(writer)
    response = browser.post(
        f"/saes/compare/?group={group.id}",
        {"action": "run", "method_core": "on", "dataset_id": dataset.id, "batch_size_prompts": "2",
         "context_size": "16", "n_eval_reconstruction_batches": "1"},
    )  # fmt: skip
    assert response.status_code == 302
    run = BenchRun.objects.exclude(status="completed").get()
    assert response["Location"].endswith(f"?run={run.id}")
    assert run.group_id == group.id and run.saes == [sae.id for sae in saes]
    assert run.config["core"]["batch_size_prompts"] == 2 and run.status == "queued"
    live = browser.get(f"/saes/compare/?run={run.id}&fragment=live").content.decode()
    assert 'data-status="queued"' in live
    # A mistake comes back in the form, and nothing is queued.
    refused = browser.post(
        f"/saes/compare/?group={group.id}", {"action": "run", "method_core": "on", "context_size": "2"}
    )
    assert refused.status_code == 400 and "context_size" in refused.content.decode()
    assert BenchRun.objects.count() == 2


def test_others_see_nothing_private(judged):
    group, saes, run, _ = judged
    other = signed_in(make_user("otto-other", "model:write"))
    assert other.get(f"/saes/compare/?group={group.id}").status_code == 404
    assert other.get(f"/saes/compare/?run={run.id}").status_code == 404
    assert other.get(f"/saes/compare/?saes={saes[0].id}").status_code == 404
    reader = signed_in(make_user("rex-reader", "model:read"))
    assert reader.post(f"/saes/compare/?group={group.id}", {"action": "run"}).status_code == 403
