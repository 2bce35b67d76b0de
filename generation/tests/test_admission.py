"""Admission of generation work (``generation.admission``): counted in work tokens (prompt + the
tokens a row may generate), bounded per user and per worker while in flight, and per minute.

The model is ``ready`` on a worker that never runs anything here: admitted rows stay queued, so
what is in flight is exactly what the test put there. Refusals are checked at the HTTP doors.
"""

import pytest

from generation.admission import MIN_ROW_WORK, row_work
from generation.models import Generation
from generation.services import SamplingRequest, generation_request, generations_withdraw
from mistudio.errors import ApplicationError
from models_app.models import LanguageModel

pytestmark = pytest.mark.django_db


def queue(model, owner, prompts: list[str], max_tokens: int) -> list[Generation]:
    return generation_request(
        model_id=model.id,
        owner=owner,
        prompts=prompts,
        sampling=SamplingRequest(max_tokens=max_tokens, max_tokens_explicit=True),
    )


def assert_refused(response, *, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert error["code"] == code
    assert int(response["Retry-After"]) == error["details"]["retry_after_seconds"] >= 1
    return error


def test_a_row_costs_its_prompt_and_the_tokens_it_may_generate(ready_model, writer):
    assert row_work("abcdefgh", 100) == 2 + 100 and row_work("a", 0) == MIN_ROW_WORK == 32
    rows = queue(ready_model, writer, ["x" * 40, "y" * 4], max_tokens=50)
    assert [row.work_tokens for row in rows] == [60, 51]


def test_a_default_max_tokens_counts_as_it_will_run_shrunk_to_the_context(ready_model, writer):
    """Without an explicit max_tokens a row generates at most to the end of the model's context,
    so that is what it costs (the default of 128 would overcount a 64-position model)."""
    context = ready_model.config["n_positions"]
    assert row_work("x" * 40, 128, explicit=False, context=context) == context < 10 + 128
    assert row_work("x" * 40, 128, explicit=True, context=context) == 10 + 128
    sampling = SamplingRequest()  # max_tokens 128, not explicit
    (row,) = generation_request(model_id=ready_model.id, owner=writer, prompts=["x" * 40], sampling=sampling)
    assert row.work_tokens == context


def test_a_user_over_their_share_in_flight_is_refused_and_nothing_is_written(
    settings, ready_model, writer, model_admin, client_for
):
    settings.GENERATION_USER_MAX_TOKENS_IN_FLIGHT = 1000
    queue(ready_model, writer, ["Hello"] * 4, max_tokens=201)  # 4 x 203 = 812 in flight
    before = Generation.objects.count()

    # 16 prompts of 30 tokens: 16 x 32 = 512 more, 1,324: over 1,000. Refused before any row is written.
    body = {"model_id": ready_model.id, "prompt": ["Hello"] * 16, "max_tokens": 30}
    error = assert_refused(
        client_for(writer).post("/api/generate", body, format="json"), status=429, code="RATE_LIMITED"
    )
    assert error["details"] | {"retry_after_seconds": 0} == {
        "scope": "generation_in_flight", "limit": 1000, "in_flight": 812, "request": 512, "unit": "tokens",
        "retry_after_seconds": 0,
    }  # fmt: skip
    chat = {"model": ready_model.id, "messages": [{"role": "user", "content": "Hi" * 400}], "max_tokens": 10}
    refused = client_for(writer).post("/v1/chat/completions", chat, format="json")
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
    # A sweep costs its rows, the baseline's and each strength's: 6 x (1 + 40) = 246.
    steer = {"type": "add", "hook": "blocks.0.hook_resid_post", "vector": [0.5] * ready_model.hidden_size}
    sweep = {"model_id": ready_model.id, "prompt": "Hi", "intervention": steer, "max_tokens": 40}
    refused_sweep = client_for(writer).post("/api/generate/sweep", sweep, format="json")
    assert_refused(refused_sweep, status=429, code="RATE_LIMITED")
    assert refused_sweep.json()["error"]["details"]["request"] == 6 * 41
    assert Generation.objects.count() == before

    # Another user's share is their own.
    assert len(queue(ready_model, model_admin, ["Hello"] * 16, max_tokens=30)) == 16
    # Rows that end leave the count: the same request is admitted once the first ones are withdrawn.
    generations_withdraw([row.id for row in Generation.objects.filter(owner=writer)])
    assert len(queue(ready_model, writer, ["Hello"] * 16, max_tokens=30)) == 16


def test_a_request_larger_than_a_share_is_400_too_large_and_writes_nothing(
    settings, ready_model, writer, client_for
):
    """One request may not be larger than one user's share: admitted alone it would hold the
    user's whole share and more (a lone 16 x 2,048 batch was 32k tokens in flight)."""
    settings.GENERATION_USER_MAX_TOKENS_IN_FLIGHT = 100
    body = {"model_id": ready_model.id, "prompt": "Hello", "max_tokens": 500}
    response = client_for(writer).post("/api/generate", body, format="json")
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "GENERATION_TOO_LARGE"
    assert error["details"] == {"request": 502, "limit": 100, "unit": "tokens"}
    assert not Generation.objects.exists()
    (row,) = queue(ready_model, writer, ["Hello"], max_tokens=98)  # exactly a share: admitted
    with pytest.raises(ApplicationError) as refused:
        queue(ready_model, writer, ["Hello"], max_tokens=1)
    assert refused.value.status == 429 and refused.value.details["in_flight"] == row.work_tokens == 100


def test_a_full_worker_is_503_model_busy_for_everyone(settings, ready_model, writer, model_admin, client_for):
    settings.GENERATION_MAX_TOKENS_IN_FLIGHT = 2000
    queue(ready_model, writer, ["Hello"] * 8, max_tokens=240)  # 8 x 242 = 1,936
    body = {"model_id": ready_model.id, "prompt": "Hello", "max_tokens": 100}
    error = assert_refused(
        client_for(model_admin).post("/api/generate", body, format="json"), status=503, code="MODEL_BUSY"
    )
    # It says the worker is full, not what anyone else has in flight.
    assert error["details"] == {"retry_after_seconds": 5} and not any(ch.isdigit() for ch in error["message"])
    # Rows of another worker's models do not count against this one.
    other = LanguageModel.objects.create(
        name="other", source="local", identifier="/x", model_type="gpt2", owner=model_admin,
        status=LanguageModel.Status.READY, host_worker="other-worker",
    )  # fmt: skip
    assert len(queue(other, model_admin, ["Hello"], max_tokens=100)) == 1


def test_the_rate_counts_work_per_minute_not_requests(settings, ready_model, writer, model_admin, client_for):
    rates = {**settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"], "generation": "1000/minute"}
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": rates}
    queue(ready_model, writer, ["Hello"] * 16, max_tokens=50)  # 16 x 52 = 832 tokens, one request
    rows = queue(ready_model, writer, ["Hello"], max_tokens=100)  # 102 more: 934
    generations_withdraw([row.id for row in Generation.objects.filter(owner=writer)])  # in flight: 0

    body = {"model_id": ready_model.id, "prompt": "Hello", "max_tokens": 100}
    error = assert_refused(
        client_for(writer).post("/api/generate", body, format="json"), status=429, code="RATE_LIMITED"
    )
    assert error["details"]["scope"] == "generation" and error["details"]["used"] == 934
    assert error["details"]["limit"] == 1000 and error["details"]["period_seconds"] == 60
    assert "1,000 tokens per minute" in error["message"]
    # Small enough to fit what is left of the minute: admitted.
    assert len(queue(ready_model, writer, ["Hi"], max_tokens=60)) == 1 and rows
    # Per user.
    assert len(queue(ready_model, model_admin, ["Hello"] * 16, max_tokens=50)) == 16


def test_a_jobs_own_requests_count_as_its_owners_share(settings, ready_model, writer):
    """An explanation job's requests through /v1 (with its job token) are its owner's work: they
    no longer skip the limits, and they meet the owner's other generations in one share."""
    from rest_framework.test import APIClient

    from mistudio.authentication import job_token_for
    from saes.models import SaeGroup

    settings.GENERATION_USER_MAX_TOKENS_IN_FLIGHT = 300
    queue(ready_model, writer, ["Hello"], max_tokens=200)  # the owner's own chat: 202 in flight
    job = SaeGroup.objects.create(status="running", owner=writer)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {job_token_for(job)}")
    body = {"model": ready_model.id, "messages": [{"role": "user", "content": "Explain"}], "max_tokens": 100}
    refused = client.post("/v1/chat/completions", body, format="json")
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "RATE_LIMITED"
    assert int(refused["Retry-After"]) >= 1
    assert Generation.objects.filter(owner=writer).count() == 1


def test_the_rate_is_one_small_entry_however_many_requests(settings, ready_model, writer):
    """The per-minute count is bucketed: a flood of small requests keeps one entry of at most
    WORK_BUCKETS counts (a list of every request grew with the flood, read and written whole)."""
    from rest_framework.throttling import SimpleRateThrottle

    from mistudio.throttling import WORK_BUCKETS

    for _ in range(40):
        generations_withdraw([row.id for row in queue(ready_model, writer, ["Hi"], max_tokens=1)])
    entry = SimpleRateThrottle.cache.get(f"throttle:work:generation:user:{writer.pk}")
    assert sum(entry.values()) == 40 * MIN_ROW_WORK and len(entry) <= WORK_BUCKETS


def test_a_users_requests_wait_for_their_own_turn_not_in_front_of_others(
    ready_model, writer, model_admin, client_for, monkeypatch
):
    """A user's requests are admitted one at a time, waited for in Redis (no pooled database
    connection held while waiting): past the wait, 429; another user is admitted meanwhile."""
    from generation import admission

    monkeypatch.setattr(admission, "USER_TURN_WAIT_SECONDS", 0.2)
    body = {"model_id": ready_model.id, "prompt": "Hello", "max_tokens": 40}
    with admission.admission_turn(writer):  # the writer's earlier request is being admitted
        refused = client_for(writer).post("/api/generate", body, format="json")
        assert len(queue(ready_model, model_admin, ["Hello"], max_tokens=40)) == 1
    assert_refused(refused, status=429, code="RATE_LIMITED")
    assert refused.json()["error"]["details"]["scope"] == "generation_in_flight"
    assert not Generation.objects.filter(owner=writer).exists()
    assert len(queue(ready_model, writer, ["Hello"], max_tokens=40)) == 1  # its turn came
