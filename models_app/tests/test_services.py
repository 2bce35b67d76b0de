"""Registering a local model: path confinement and what is read from its files."""

import os

import pytest
from django.conf import settings
from django.core.management import call_command
from transformers import AutoModelForCausalLM

from mistudio.errors import ApplicationError
from models_app.services import local_model_folder, model_register

pytestmark = pytest.mark.django_db


def test_register_reads_config_and_exact_parameter_count_without_loading(tiny_gpt2_folder):
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny", owner=None)
    reference = AutoModelForCausalLM.from_pretrained(tiny_gpt2_folder, use_safetensors=True)
    assert model.id.startswith("m_") and model.status == "pending"
    assert model.model_type == "gpt2" and model.architecture == "GPT2LMHeadModel"
    assert model.hidden_size == reference.config.n_embd
    assert model.num_layers == reference.config.n_layer
    assert model.vocab_size == reference.config.vocab_size
    # Tied embeddings are stored once in safetensors, and counted once by torch too.
    assert model.parameter_count == reference.num_parameters()


@pytest.mark.parametrize(
    "make_path",
    [
        lambda root, tmp: str(tmp),  # elsewhere on disk
        lambda root, tmp: f"{root}/../..",  # climbing out
        lambda root, tmp: f"{root}/tiny-gpt2\x00/etc",  # NUL byte
        lambda root, tmp: "",
    ],
)
def test_paths_outside_the_model_roots_are_refused(make_path, tmp_path, tiny_gpt2_folder):
    root = settings.LOCAL_MODEL_ROOTS[0]
    with pytest.raises(ApplicationError) as caught:
        local_model_folder(make_path(root, tmp_path))
    assert caught.value.code == "INVALID_LOCAL_PATH"


def test_a_symlink_pointing_out_of_the_roots_is_refused(tmp_path, tiny_gpt2_folder):
    outside = tmp_path / "outside-model"
    outside.mkdir()
    link = settings.LOCAL_MODEL_ROOTS[0] / "sneaky-link"
    link.unlink(missing_ok=True)
    os.symlink(outside, link)
    try:
        with pytest.raises(ApplicationError) as caught:
            local_model_folder(str(link))
        assert caught.value.code == "INVALID_LOCAL_PATH"
    finally:
        link.unlink()


def test_a_folder_with_only_pickle_weights_is_refused(tmp_path):
    folder = settings.LOCAL_MODEL_ROOTS[0] / "pickled"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "gpt2"}')
    (folder / "pytorch_model.bin").write_bytes(b"not unpickled, ever")
    with pytest.raises(ApplicationError) as caught:
        model_register(source="local", identifier=str(folder), name="pickled", owner=None)
    assert caught.value.code == "UNSAFE_WEIGHTS"


def test_create_user_prints_a_working_token_and_sets_the_role(capsys):
    from rest_framework.test import APIClient

    call_command("create_user", "carol", "--role", "model:write")
    token = capsys.readouterr().out.strip()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert client.get("/api/models").status_code == 200
    from django.contrib.auth import get_user_model

    carol = get_user_model().objects.get(username="carol")
    assert carol.has_perm("models_app.model_write") and not carol.has_perm("models_app.model_admin")
    assert not carol.has_usable_password()
