"""Training from the model, many at once, through the whole stack: API → queue → real worker → the
model run over the dataset → every member's SAELens folder, curves and held-out evaluation, the
group page's plots; the held-out numbers recomputed independently with transformers."""

import io
import json
import tarfile

import pytest
import torch
from django.test import Client
from safetensors.torch import load as safetensors_load
from transformers import AutoModelForCausalLM, AutoTokenizer

from activations.models import ActivationCache, Dataset
from activations.services import dataset_create_from_texts
from conftest import make_user
from engine.sae.formats import load_saelens
from engine.testing.corpus import local_corpus
from features.models import Feature, FeatureAnalysis
from mistudio.workers import run_worker
from saes.models import SaeGroup
from saes.models import SparseAutoencoder as SaeRow
from saes.tests.test_training_job import burst

pytestmark = pytest.mark.django_db(transaction=True)
RESID, MLP_IN, MLP_OUT = "blocks.0.hook_resid_post", "blocks.1.ln2.hook_normalized", "blocks.1.hook_mlp_out"


@pytest.fixture
def texts_dataset(writer):
    texts = [text for text in local_corpus(max_chars=40_000) if len(text) > 40][:160]
    return dataset_create_from_texts(name="docs", texts=texts, owner=writer, source=Dataset.Source.UPLOAD)


def _request(api, model, dataset, **changes):
    body = {
        "model_id": model.id, "dataset_id": dataset.id, "hooks": [RESID],
        "transcoders": [{"hook_in": MLP_IN, "hook_out": MLP_OUT, "skip": True}],
        "variants": [{"k": 4}, {"architecture": "batchtopk", "k": 8}],
        "expansion_factor": 2, "batch_size": 128, "total_tokens": 128 * 10, "max_length": 32, "lr": 3e-3,
        **changes,
    }  # fmt: skip
    return api.post("/api/saes/groups", body, format="json")


def test_a_group_trains_from_the_model_and_each_member_is_evaluated_and_compared(
    tiny_gpt2_folder, tiny_model, writer, client_for, texts_dataset
):
    api = client_for(writer)
    response = _request(api, tiny_model, texts_dataset)
    assert response.status_code == 202, response.content
    body = response.json()
    assert body["status"] == "queued" and len(body["members"]) == 4
    assert [(m["hook_name"], m["hook_name_out"], m["architecture"], m["k"]) for m in body["members"]] == [
        (RESID, None, "topk", 4), (RESID, None, "batchtopk", 8),
        (MLP_IN, MLP_OUT, "topk", 4), (MLP_IN, MLP_OUT, "batchtopk", 8),
    ]  # fmt: skip
    burst()  # loads the model here, trains the four from one forward pass a batch, evaluates
    group = SaeGroup.objects.get(pk=body["id"])
    assert group.status == "completed", (group.error_code, group.error_message)
    assert group.step == group.total_steps == 10 and group.tokens_per_second > 0
    assert not group.checkpoint_directory.exists()  # checkpoints go with a completed group
    members = list(group.members.order_by("group_index"))
    assert all(member.status == "completed" for member in members)
    for member in members:  # each its own curves and evaluation
        assert member.history and member.history[-1]["step"] == 10
        assert member.evaluation["ce_loss_recovered"] is not None and member.evaluation["l0"] > 0
    # A small group analyses its members when it ends (the default), over its dataset through the
    # model: dashboards, labels and graph node names with no cache written.
    assert body["analyze_members"] is True
    for member in members:
        (analysis,) = FeatureAnalysis.objects.filter(sae=member)
        assert analysis.status == "completed", (analysis.error_code, analysis.error_message)
        assert analysis.source == "model" and analysis.dataset_id == texts_dataset.id
        assert analysis.cache_id is None and analysis.reading["max_length"] == 32
        assert Feature.objects.filter(analysis=analysis).count() == member.d_sae
    assert not ActivationCache.objects.exists()

    # The held-out numbers of the first member, recomputed with transformers on the held-out samples.
    held_out_texts = [
        json.loads(line)["text"] for line in texts_dataset.storage_path.read_text().splitlines()
    ]
    held_out_texts = held_out_texts[group.settings["train_samples"] :]
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_folder)
    reference = AutoModelForCausalLM.from_pretrained(tiny_gpt2_folder, use_safetensors=True).eval()
    rows = []
    with torch.no_grad():
        for text in held_out_texts:
            ids = tokenizer(text, truncation=True, max_length=32)["input_ids"]
            if ids:
                rows.append(reference(torch.tensor([ids]), output_hidden_states=True).hidden_states[1][0])
    held_out = torch.cat(rows)
    module, described = load_saelens(members[0].directory)
    with torch.no_grad():
        residual = (held_out - module(held_out)).pow(2).sum()
    variance = (held_out - held_out.mean(0)).pow(2).sum()
    assert members[0].evaluation["held_out_tokens"] == len(held_out)
    assert members[0].evaluation["explained_variance"] == pytest.approx(
        float(1 - residual / variance), abs=1e-4
    )
    assert described["cfg"]["metadata"]["training"]["k"] == 4

    # The transcoders: SAELens' transcoder classes (BatchTopK: the JumpReLU it is at inference).
    _, topk_tc = load_saelens(members[2].directory)
    jump_tc, jump_described = load_saelens(members[3].directory)
    assert jump_described["cfg"]["architecture"] == "jumprelu_skip_transcoder"
    assert jump_described["cfg"]["d_out"] == 64 and jump_described["hook_name_out"] == MLP_OUT
    assert topk_tc["cfg"]["architecture"] == "topk" and jump_tc.W_skip is not None
    # The JumpReLU one also exports in circuit-tracer's layout (layer_<i>.safetensors).
    export = api.get(f"/api/saes/{members[3].id}/export")
    with tarfile.open(fileobj=io.BytesIO(b"".join(export.streaming_content))) as archive:
        layer = archive.extractfile(f"{members[3].id}/circuit_tracer/layer_1.safetensors").read()
    tensors = safetensors_load(layer)
    torch.testing.assert_close(tensors["W_enc"], jump_tc.W_enc.T, atol=0, rtol=0)
    torch.testing.assert_close(tensors["activation_function.threshold"], jump_tc.threshold, atol=0, rtol=0)
    assert tensors["W_skip"].shape == (64, 64)
    assert not (members[2].directory / "circuit_tracer").exists()  # circuit-tracer reads no TopK

    # The group page compares them: two frontier plots with a dot per member, and the table.
    browser = Client()
    browser.force_login(writer)
    page = browser.get(f"/saes/groups/{group.id}/")
    html = page.content.decode()
    assert page.status_code == 200 and html.count('data-points="4"') == 2
    # Its owner may stop it and keep it, or cancel it after a confirmation (hidden once it ended).
    assert 'id="stop-group"' in html and 'id="cancel-group" data-confirm="Cancel this group?' in html
    assert html.count('<tr data-sae-id="') == 4

    # Shared: another user sees the group and its members, never the owner's private dataset.
    other = client_for(make_user("otto-other", "model:write"))
    assert other.get(f"/api/saes/groups/{group.id}").status_code == 404
    assert api.patch(f"/api/saes/groups/{group.id}", {"shared": True}, format="json").status_code == 200
    seen = other.get(f"/api/saes/groups/{group.id}").json()
    assert seen["dataset_id"] is None and len(seen["members"]) == 4
    member = other.get(f"/api/saes/{members[0].id}").json()
    assert member["dataset_id"] is None and member["group_id"] == group.id
    assert api.get(f"/api/saes/{members[0].id}").json()["dataset_id"] == texts_dataset.id


def test_a_cross_layer_transcoder_trains_from_the_model_in_a_group_and_attributes(
    tiny_gpt2_folder, tiny_model, writer, client_for, texts_dataset
):
    """A CLT member over every layer: trained beside an SAE from the same forward passes, judged
    per layer and with every MLP replaced at once (recomputed independently from transformers'
    MLPs on the held-out samples), saved in circuit-tracer's layout, not analysed, attributed."""
    from engine.sae.clt import load_clt
    from engine.sae.clt_training import ce_loss_recovered_all_mlps, clt_explained_variance, mlp_rows

    api = client_for(writer)
    response = _request(api, tiny_model, texts_dataset, transcoders=[], variants=[], k=4,
                        cross_layer_transcoder=True)  # fmt: skip
    assert response.status_code == 202, response.content
    members = response.json()["members"]
    assert [(m["hook_name"], m["hook_name_out"], m["architecture"]) for m in members] == [
        (RESID, None, "topk"),
        ("blocks.0.ln2.hook_normalized", MLP_OUT, "jumprelu"),
    ]
    burst()
    group = SaeGroup.objects.get(pk=response.json()["id"])
    assert group.status == "completed", (group.error_code, group.error_message)
    clt_row = SaeRow.objects.get(pk=members[1]["id"])
    assert clt_row.n_layers == 2 and clt_row.status == "completed" and clt_row.history[-1]["step"] == 10
    assert clt_row.hyperparameters["kind"] == "clt" and clt_row.hyperparameters["k"] == 4
    assert not FeatureAnalysis.objects.filter(sae=clt_row).exists()  # analyses are single-layer for now
    clt = load_clt(clt_row.directory / "clt")

    # Its evaluation, recomputed on the held-out samples read with transformers.
    held_out_texts = [
        json.loads(line)["text"] for line in texts_dataset.storage_path.read_text().splitlines()
    ]
    held_out_texts = held_out_texts[group.settings["train_samples"] :]
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_folder)
    reference = AutoModelForCausalLM.from_pretrained(tiny_gpt2_folder, use_safetensors=True).eval()
    batches = [torch.tensor([ids]) for text in held_out_texts
               if len(ids := tokenizer(text, truncation=True, max_length=32)["input_ids"]) >= 2]  # fmt: skip
    inputs, outputs = mlp_rows(reference, batches)
    evaluation = clt_row.evaluation
    assert evaluation["explained_variance_per_layer"] == pytest.approx(
        clt_explained_variance(clt, inputs, outputs), abs=1e-4
    )
    ce = ce_loss_recovered_all_mlps(reference, batches, clt)
    assert evaluation["ce_loss_with_sae"] == pytest.approx(ce["replaced"], abs=1e-4)
    assert evaluation["ce_loss_recovered"] == pytest.approx(ce["recovered"], abs=1e-3)

    # An attribution graph through it.
    body = {"model_id": tiny_model.id, "prompt": "The cat sat on the mat", "transcoder_ids": [clt_row.id]}
    graph = api.post("/api/graphs", {**body, "batch_size": 8}, format="json")
    assert graph.status_code == 202, graph.content
    burst()
    assert api.get(f"/api/graphs/{graph.json()['id']}").json()["status"] == "completed"


def test_a_queued_group_cancelled_cancels_its_members_and_requests_are_checked(
    tiny_model, writer, client_for, texts_dataset
):
    api = client_for(writer)
    group_id = _request(api, tiny_model, texts_dataset).json()["id"]
    member = SaeRow.objects.filter(group_id=group_id).first()
    # A member is part of its group's job: cancelling it cancels the group.
    assert api.post(f"/api/saes/{member.id}/cancel").status_code == 202
    assert SaeGroup.objects.get(pk=group_id).status == "cancelled"
    assert set(SaeRow.objects.filter(group_id=group_id).values_list("status", flat=True)) == {"cancelled"}
    run_worker(name="idle", device="cpu", burst=True)  # nothing left to run
    assert not FeatureAnalysis.objects.exists()  # a group that did not complete analyses nothing
    unanalysed = _request(api, tiny_model, texts_dataset, analyze_members=False).json()
    assert unanalysed["analyze_members"] is False
    assert api.post(f"/api/saes/groups/{unanalysed['id']}/cancel").status_code == 202
    # Bad requests: a clear 4xx, nothing queued.
    before = SaeGroup.objects.count()
    wrong_hook = _request(api, tiny_model, texts_dataset, hooks=["blocks.9.hook_resid_post"])
    assert wrong_hook.status_code == 400 and wrong_hook.json()["error"]["code"] == "INVALID_HOOK"
    too_many = _request(api, tiny_model, texts_dataset, variants=[{"k": k} for k in range(1, 18)])
    assert too_many.status_code == 400 and too_many.json()["error"]["code"] == "GROUP_TOO_LARGE"
    nothing = _request(api, tiny_model, texts_dataset, hooks=[], transcoders=[])
    assert nothing.status_code == 400 and nothing.json()["error"]["code"] == "HOOK_REQUIRED"
    unknown = _request(api, tiny_model, texts_dataset, variants=[{"momentum": 0.9}])
    assert unknown.status_code == 400
    assert SaeGroup.objects.count() == before


def test_a_transcoder_evaluates_on_a_cache_of_both_hooks_is_analysed_and_steers_at_its_output(
    tiny_model, writer, client_for, texts_dataset
):
    from activations.models import ExtractionJob
    from features.models import FeatureAnalysis

    api = client_for(writer)
    body = _request(
        api, tiny_model, texts_dataset, hooks=[], variants=[{"architecture": "batchtopk", "k": 8}]
    )
    body = body.json()
    transcoder_id = body["members"][0]["id"]
    extraction = api.post(
        f"/api/models/{tiny_model.id}/extract-activations",
        {"dataset_id": texts_dataset.id, "hooks": [MLP_IN, MLP_OUT], "max_length": 32},
        format="json",
    ).json()
    burst()  # the group, then the cache of both hooks
    assert SaeGroup.objects.get(pk=body["id"]).status == "completed"
    cache = ExtractionJob.objects.get(pk=extraction["extraction_id"]).cache
    # A cache without the output hook cannot evaluate it; one with both can.
    row = api.get(f"/api/saes/{transcoder_id}").json()
    assert row["feature_hook"] == MLP_OUT and row["d_out"] == 64
    evaluated = api.post(f"/api/saes/{transcoder_id}/evaluate", {"cache_id": cache.id}, format="json")
    assert evaluated.status_code == 202, evaluated.content
    analysis = api.post(f"/api/saes/{transcoder_id}/analyses", {"cache_id": cache.id}, format="json")
    assert analysis.status_code == 202, analysis.content
    burst()
    evaluation = SaeRow.objects.get(pk=transcoder_id).evaluation
    assert evaluation["error"] is None and 0 < evaluation["explained_variance"] <= 1
    assert evaluation["ce_loss_recovered"] is not None and evaluation["cache_id"] == cache.id
    assert FeatureAnalysis.objects.get(pk=analysis.json()["id"]).status == "completed"
    # Steering: its features are added at the output hook; clamping one is refused (400).
    clamp = api.post(
        "/api/generate",
        {"model_id": tiny_model.id, "prompt": "The", "max_tokens": 2, "mistudio": {"interventions": [
            {"type": "clamp_feature", "sae": transcoder_id, "feature": 0, "value": 1.0}]}},
        format="json",
    )  # fmt: skip
    assert clamp.status_code == 400 and "transcoder" in clamp.json()["error"]["message"]


def test_a_group_that_has_ended_is_deleted_by_its_owner_and_its_members_stay(
    tiny_model, writer, client_for, texts_dataset
):
    """DELETE /api/saes/groups/{id}: a queued or running group is 409 (cancel it first); once ended,
    its owner deletes the row (another user gets 404, a reader 403) and its checkpoints go; its
    member SAEs stay, each an SAE of its own."""
    api = client_for(writer)
    group_id = _request(api, tiny_model, texts_dataset).json()["id"]
    members = set(SaeRow.objects.filter(group_id=group_id).values_list("pk", flat=True))
    busy = api.delete(f"/api/saes/groups/{group_id}")
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "SAE_GROUP_BUSY"
    assert api.post(f"/api/saes/groups/{group_id}/cancel").status_code == 202
    group = SaeGroup.objects.get(pk=group_id)
    group.directory.mkdir(parents=True, exist_ok=True)  # checkpoints a run would have left
    (group.directory / "checkpoint.safetensors").write_bytes(b"x")

    other = make_user("olga-other", "model:write")
    assert client_for(other).delete(f"/api/saes/groups/{group_id}").status_code == 404
    reader = make_user("rita-reader", "model:read")
    assert client_for(reader).delete(f"/api/saes/groups/{group_id}").status_code == 403
    assert SaeGroup.objects.filter(pk=group_id).exists()

    assert api.delete(f"/api/saes/groups/{group_id}").status_code == 204
    assert not SaeGroup.objects.filter(pk=group_id).exists() and not group.directory.exists()
    assert set(SaeRow.objects.filter(pk__in=members, group=None).values_list("pk", flat=True)) == members
    assert api.get(f"/api/saes/groups/{group_id}").status_code == 404
    assert api.delete(f"/api/saes/{next(iter(members))}").status_code == 204  # as any SAE


def test_a_running_group_stopped_early_keeps_its_members_evaluated(
    tiny_model, writer, client_for, texts_dataset
):
    """Before: cancelling kept nothing; now "stop and keep" ends training at the next step and
    evaluates every member from what it learnt."""
    import threading

    from models_app.tests.live_stack import wait_until

    api = client_for(writer)
    body = _request(api, tiny_model, texts_dataset, hooks=[RESID], transcoders=[], variants=[],
                    total_tokens=128 * 5000, analyze_members=False).json()  # fmt: skip
    group = SaeGroup.objects.get(pk=body["id"])
    worker = threading.Thread(target=burst)
    worker.start()
    try:
        wait_until(lambda: SaeGroup.objects.filter(pk=group.pk, step__gte=2).exists(), timeout=120,
                   what="the group to train a few steps")  # fmt: skip
        stopped = api.post(f"/api/saes/groups/{group.id}/stop")
        assert stopped.status_code == 202, stopped.content
    finally:
        worker.join(timeout=300)
    group.refresh_from_db()
    assert group.status == "completed", (group.error_code, group.error_message)
    assert 0 < group.tokens_seen < group.total_tokens == 128 * 5000
    (member,) = group.members.all()
    assert member.status == "completed" and member.evaluation["explained_variance"] is not None
    assert (member.directory / "sae_weights.safetensors").exists()
    again = api.post(f"/api/saes/groups/{group.id}/stop")
    assert again.status_code == 409 and again.json()["error"]["code"] == "JOB_NOT_ACTIVE"
