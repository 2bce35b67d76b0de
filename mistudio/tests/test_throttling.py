"""Rate limits and extraction caps at every door, counted in the real Redis, on real rows.

The root conftest clears the counts before each test (``fresh_rate_limits``).
"""

import pytest
from django.conf import settings
from django.test import RequestFactory
from rest_framework.request import Request

from activations.models import ActivationCache, Dataset, ExtractionJob
from activations.services import dataset_create_from_texts
from mistudio.throttling import ModelLoadThrottle
from models_app.models import LanguageModel
from steering.models import SteeringVector

pytestmark = pytest.mark.django_db
LOADS_PER_HOUR = 10  # the default of RATE_LIMIT_MODEL_LOADS_PER_HOUR


def assert_rate_limited(response, *, scope: str) -> dict:
    """The documented 429: our error body, ``details.retry_after_seconds`` and the same ``Retry-After``."""
    assert response.status_code == 429, response.content
    error = response.json()["error"]
    assert set(error) == {"code", "message", "details", "timestamp"}
    assert error["code"] == "RATE_LIMITED" and error["details"]["scope"] == scope
    wait = error["details"]["retry_after_seconds"]
    assert isinstance(wait, int) and wait >= 1
    assert response["Retry-After"] == str(wait)
    return error


def register(api, folder) -> str:
    response = api.post("/api/models", {"source": "local", "model_identifier": str(folder)}, format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def load_and_cancel(api, model_id: str, **headers):
    """One accepted load (202), cancelled at once so that the next one is accepted too."""
    response = api.post(f"/api/models/{model_id}/load", {}, format="json", **headers)
    if response.status_code == 202:
        assert api.post(f"/api/models/{model_id}/cancel", {}, format="json").status_code == 202
    return response


# --- model loads ---------------------------------------------------------------------------------


def test_the_eleventh_load_in_an_hour_is_429_and_other_users_are_not_affected(
    writer, model_admin, client_for, tiny_gpt2_folder
):
    assert settings.RATE_LIMIT_MODEL_LOADS_PER_HOUR == LOADS_PER_HOUR
    api = client_for(writer)
    model_id = register(api, tiny_gpt2_folder)
    for _ in range(LOADS_PER_HOUR):
        assert load_and_cancel(api, model_id).status_code == 202

    refused = load_and_cancel(api, model_id)
    error = assert_rate_limited(refused, scope="model_load")
    assert error["details"]["limit"] == LOADS_PER_HOUR and error["details"]["period_seconds"] == 3600
    assert 3500 < error["details"]["retry_after_seconds"] <= 3600  # the first load leaves the window
    assert LanguageModel.objects.get(pk=model_id).status == "failed"  # nothing was queued

    # A spoofed X-Forwarded-For (or any other address) does not make a new client: users count by id.
    spoofed = load_and_cancel(api, model_id, HTTP_X_FORWARDED_FOR="203.0.113.9", REMOTE_ADDR="198.51.100.7")
    assert_rate_limited(spoofed, scope="model_load")
    # A registration with auto_load is a load too; one without is not.
    assert_rate_limited(
        api.post("/api/models", {"model_identifier": "gpt2", "auto_load": True}, format="json"),
        scope="model_load",
    )
    plain = api.post("/api/models", {"model_identifier": "not a valid id!"}, format="json")
    assert plain.status_code == 400  # reached the view: not throttled

    other = client_for(model_admin)
    other_model = LanguageModel.objects.create(
        name="other", source="local", identifier="/elsewhere", model_type="gpt2", owner=model_admin
    )
    assert other.post(f"/api/models/{other_model.id}/load", {}, format="json").status_code != 429


def test_anonymous_clients_are_counted_by_the_address_they_cannot_choose(settings):
    """DRF's ``get_ident`` uses the whole X-Forwarded-For when NUM_PROXIES is unset; ours is set."""
    factory = RequestFactory()

    def ident(**meta) -> str:
        return ModelLoadThrottle().get_cache_key(Request(factory.post("/", **meta)), None)

    assert settings.REST_FRAMEWORK["NUM_PROXIES"] == 0
    plain = ident(REMOTE_ADDR="198.51.100.7")
    assert plain.endswith("address:198.51.100.7")
    assert ident(REMOTE_ADDR="198.51.100.7", HTTP_X_FORWARDED_FOR="203.0.113.9") == plain

    # Behind one proxy, the entry that proxy appended counts, not what the client wrote before it.
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "NUM_PROXIES": 1}
    behind_proxy = ident(REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="203.0.113.9, 198.51.100.7")
    assert behind_proxy.endswith("address:198.51.100.7")


# --- job caps (every kind together) ---------------------------------------------------------------


@pytest.fixture
def extraction_setup(tiny_gpt2_folder, writer, model_admin, client_for):
    """A model and one dataset per user, owned by that user (different texts: different cache keys)."""
    model = LanguageModel.objects.create(
        name="tiny",
        source="local",
        identifier=str(tiny_gpt2_folder),
        model_type="gpt2",
        config=__import__("json").loads((tiny_gpt2_folder / "config.json").read_text()),
        owner=writer,
    )
    datasets = {
        user.pk: dataset_create_from_texts(
            name=f"texts of {user.username}",
            texts=["one", "two", user.username],
            owner=user,
            source="builtin",
        )
        for user in (writer, model_admin)
    }
    return model, datasets


def extract(api, model, dataset, **body):
    request = {"dataset_id": dataset.id, "layer_indices": [0], "max_length": 16, **body}
    return api.post(f"/api/models/{model.id}/extract-activations", request, format="json")


def running_rows(model, dataset: Dataset, owner, count: int) -> list[ExtractionJob]:
    return [
        ExtractionJob.objects.create(
            model=model, dataset=dataset, owner=owner, status="running", eta_seconds=42
        )
        for _ in range(count)
    ]


def test_a_fifth_job_of_one_user_is_429_whatever_its_kind_while_another_user_goes_on(
    extraction_setup, writer, model_admin, client_for
):
    model, datasets = extraction_setup
    per_user = settings.MAX_ACTIVE_JOBS_PER_USER
    assert per_user == 4
    mine = running_rows(model, datasets[writer.pk], writer, per_user - 1)
    vector = SteeringVector.objects.create(model=model, hook_name="blocks.0.hook_resid_post", owner=writer)
    refused = extract(client_for(writer), model, datasets[writer.pk])
    error = assert_rate_limited(refused, scope="user")
    assert error["details"]["limit"] == per_user
    assert error["details"]["active_jobs"] == [
        *({"kind": "extraction", "id": job.id, "status": "running"} for job in mine),
        {"kind": "vector", "id": vector.id, "status": "queued"},
    ]
    assert error["details"]["retry_after_seconds"] == 42  # the soonest running job's ETA
    assert ExtractionJob.objects.count() == per_user - 1  # nothing was created, no cache row was left
    assert not ActivationCache.objects.exists()
    # Every kind counts against the same cap: a steering vector is refused too.
    vector_body = {
        "model_id": model.id,
        "hook_name": "blocks.0.hook_resid_post",
        "positive": ["a"],
        "negative": ["b"],
    }
    assert_rate_limited(
        client_for(writer).post("/api/steering-vectors", vector_body, format="json"), scope="user"
    )

    accepted = extract(client_for(model_admin), model, datasets[model_admin.pk])
    assert accepted.status_code == 202, accepted.content

    # One ends: the writer's next request is accepted.
    ExtractionJob.objects.filter(pk=mine[0].pk).update(status="completed")
    assert extract(client_for(writer), model, datasets[writer.pk]).status_code == 202


def test_the_job_after_the_system_wide_cap_is_429_for_anyone(
    extraction_setup, writer, model_admin, client_for
):
    model, datasets = extraction_setup
    running_rows(model, datasets[writer.pk], None, settings.MAX_ACTIVE_JOBS)  # e.g. CLI jobs
    refused = extract(client_for(model_admin), model, datasets[model_admin.pk])
    error = assert_rate_limited(refused, scope="system")
    assert error["details"]["limit"] == 16 and "active_jobs" not in error["details"]


@pytest.mark.django_db(transaction=True)  # the burst worker in this process closes connections
def test_joining_an_identical_job_or_reusing_a_cache_does_not_count(extraction_setup, writer, client_for):
    from mistudio.workers import run_worker

    model, datasets = extraction_setup
    api, dataset = client_for(writer), datasets[writer.pk]
    # A real job, run by a real worker, leaves a completed cache.
    first = extract(api, model, dataset)
    assert first.status_code == 202, first.content
    run_worker(name="throttle-worker", device="cpu", burst=True)
    assert ExtractionJob.objects.get(pk=first.json()["extraction_id"]).status == "completed"

    queued = extract(api, model, dataset, layer_indices=[1])  # a second key, still queued
    assert queued.status_code == 202
    running_rows(model, dataset, writer, settings.MAX_ACTIVE_JOBS_PER_USER - 1)  # the writer is at the cap
    assert_rate_limited(extract(api, model, dataset, layer_indices=[0, 1]), scope="user")

    joined = extract(api, model, dataset, layer_indices=[1])
    assert joined.status_code == 202 and joined.json()["extraction_id"] == queued.json()["extraction_id"]
    cached = extract(api, model, dataset)
    assert cached.status_code == 200 and cached.json()["cached"] is True


# --- worker calls ---------------------------------------------------------------------------------
# Generation is limited by the work it asks for, in flight and per minute: generation/tests/test_admission.py.


@pytest.fixture
def unloaded_model(writer, tiny_gpt2_folder):
    """Requests for it get as far as the model lookup (409 MODEL_NOT_LOADED): each one counts."""
    return LanguageModel.objects.create(
        name="tiny", source="local", identifier=str(tiny_gpt2_folder), model_type="gpt2", owner=writer
    )


def test_worker_calls_share_one_rate_per_user(settings, writer, model_admin, client_for, unloaded_model):
    """Live encoding, patching and the logit lens each hold a model's worker: one count between them."""
    rates = {**settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"], "worker_call": "3/minute"}
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": rates}
    api, model = client_for(writer), unloaded_model
    lens = f"/api/models/{model.id}/logit-lens"
    patching = f"/api/models/{model.id}/patching"
    body = {"clean": "a b", "corrupted": "a c", "answer": " b", "wrong_answer": " c"}
    assert api.post(lens, {"prompt": "Hello"}, format="json").status_code == 409  # not loaded: counted
    assert api.post(patching, body, format="json").status_code == 409
    assert api.post(lens, {"prompt": "Hello"}, format="json").status_code == 409
    error = assert_rate_limited(api.post(patching, body, format="json"), scope="worker_call")
    assert error["details"]["limit"] == 3 and error["details"]["period_seconds"] == 60
    assert client_for(model_admin).post(lens, {"prompt": "Hello"}, format="json").status_code != 429


# --- settings -------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=False)
@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("RATE_LIMIT_MODEL_LOADS_PER_HOUR", "ten", "is not an integer"),
        ("RATE_LIMIT_GENERATION_TOKENS_PER_MINUTE", "-1", "must be at least 0"),
        ("MAX_ACTIVE_JOBS_PER_USER", "2.5", "is not an integer"),
        ("NUM_PROXIES", "-1", "must be at least 0"),
    ],
)
def test_a_bad_limit_stops_start_up_naming_the_variable(variable, value, says):
    from mistudio.tests.test_settings import start_django

    result = start_django(**{variable: value})
    assert result.returncode != 0 and "ImproperlyConfigured" in result.stderr
    assert variable in result.stderr and says in result.stderr
