"""Graph nodes named by analyses made straight from the model: transcoders that no cache ever fed
(trained from the model, or imported) are analysed over a dataset through the model, and the
graph's feature nodes then carry the analyses' automatic labels (marked as such) where nobody
labelled or explained them. Before, such nodes had no name at all."""

import pytest

from activations.services import dataset_create_from_texts
from circuits.tests.conftest import computed_graph, transcoder_rows
from engine.testing.corpus import local_corpus
from features.models import Feature, FeatureLabel
from features.services import analysis_request
from mistudio.workers import run_worker
from models_app.tests.burst_worker import load_on_burst_worker

pytestmark = pytest.mark.django_db(transaction=True)
WORKER = "graph-labels-worker"


def test_nodes_of_transcoders_analysed_from_the_model_carry_their_automatic_labels(
    tiny_gpt2_folder, writer, client_for
):
    model = load_on_burst_worker(tiny_gpt2_folder, writer, worker=WORKER)
    prose = dataset_create_from_texts(name="prose", texts=local_corpus()[:24], owner=writer, source="upload")
    transcoders = transcoder_rows(model, tiny_gpt2_folder, writer)
    analyses = [analysis_request(owner=writer, sae=sae, dataset=prose, max_length=32) for sae in transcoders]
    api = client_for(writer)
    graph = computed_graph(api, model, transcoders, worker=WORKER, prompt="The cat sat on the mat")
    run_worker(name=WORKER, device="cpu", burst=True)
    for analysis in analyses:
        analysis.refresh_from_db()
        assert analysis.status == "completed" and analysis.source == "model", analysis.error_message

    view = api.get(f"/api/graphs/{graph.id}/nodes").json()
    features = [node for node in view["nodes"] if node["feature_type"] == "cross layer transcoder"]
    assert features
    named = 0
    for node in features:
        layer, index, _ = (int(part) for part in node["node_id"].split("_"))
        automatic = Feature.objects.get(analysis=analyses[layer], index=index).auto_label
        assert view["mistudio"]["features"][f"{layer}_{index}"]["auto_label"] == automatic
        assert node["clerp"] == (f"auto: {automatic}" if automatic else "")
        named += bool(automatic)
    assert named  # some nodes carry a name that the analyses gave them

    # A researcher's label comes first.
    layer, index, _ = (int(part) for part in features[0]["node_id"].split("_"))
    FeatureLabel.objects.create(sae=transcoders[layer], index=index, label="mats", owner=writer)
    relabelled = api.get(f"/api/graphs/{graph.id}/nodes").json()
    assert next(n for n in relabelled["nodes"] if n["node_id"] == features[0]["node_id"])["clerp"] == "mats"


def test_a_process_without_the_servers_model_roots_names_the_setting(
    tiny_gpt2_folder, writer, settings, tmp_path
):
    """Before: ``attribute_prompt`` run without the server's LOCAL_MODEL_ROOTS said "The model's
    tokenizer is not on this machine" although the files were there."""
    from circuits.services import prompt_tokens
    from mistudio.errors import ApplicationError
    from models_app.services import model_register

    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=writer)
    assert prompt_tokens(model, "The cat")[0]  # with the server's roots: its tokenizer
    settings.LOCAL_MODEL_ROOTS = [tmp_path]  # as a command run with other settings sees them
    with pytest.raises(ApplicationError) as missing:
        prompt_tokens(model, "The cat")
    assert missing.value.code == "MODEL_FILES_MISSING" and "LOCAL_MODEL_ROOTS" in missing.value.message
    assert str(tiny_gpt2_folder) not in missing.value.message  # never a server path
