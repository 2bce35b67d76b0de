"""Moving Generation from models_app into this app keeps every row and its permissions."""

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [
    ("models_app", "0004_sharing"),
    ("activations", "0003_sharing"),
    ("contenttypes", "0002_remove_content_type_name"),
]


def _migrate(targets):
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


def test_generation_rows_and_their_content_type_survive_the_move_to_the_generation_app():
    latest = MigrationExecutor(connection).loader.graph.leaf_nodes()
    old_apps = _migrate(BEFORE)
    try:
        old_generation = old_apps.get_model("models_app", "Generation")
        old_model = old_apps.get_model("models_app", "LanguageModel")
        content_types = old_apps.get_model("contenttypes", "ContentType")
        content_types.objects.get_or_create(app_label="models_app", model="generation")
        model = old_model.objects.create(id="mdl_moved", name="moved", identifier="x/y", model_type="gpt2")
        old_generation.objects.create(
            id="gen_moved", model=model, prompt="Once upon", output_text="a time", output_token_ids=[5, 6]
        )
        old_type_id = content_types.objects.get(app_label="models_app", model="generation").pk
    finally:
        _migrate(latest)

    from django.contrib.contenttypes.models import ContentType

    from generation.models import Generation

    ContentType.objects.clear_cache()
    moved = Generation.objects.get(pk="gen_moved")
    assert (moved.model_id, moved.prompt, moved.output_text, moved.output_token_ids) == (
        "mdl_moved",
        "Once upon",
        "a time",
        [5, 6],
    )
    assert ContentType.objects.get_for_model(Generation).pk == old_type_id
    assert not ContentType.objects.filter(app_label="models_app", model="generation").exists()
