"""Job tokens (``mistudio.authentication``): a job's requests to this workbench's own /v1 act for its
owner while, and only while, the job the token names is queued or running. Real rows, real
requests through the API."""

from __future__ import annotations

import pytest
from django.core import signing
from rest_framework.test import APIClient

from mistudio.authentication import JOB_TOKEN_PREFIX, JOB_TOKEN_SALT, job_token_for
from saes.models import SaeGroup

pytestmark = pytest.mark.django_db


def chat(token: str):
    """A chat completion sent with ``token`` (an empty body: past authentication it is a 400)."""
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client.post("/v1/chat/completions", {}, format="json")


@pytest.fixture
def job(writer):
    return SaeGroup.objects.create(status="running", owner=writer)


def test_a_job_token_is_good_while_its_job_is_queued_or_running(job):
    token = job_token_for(job)
    for status in ("queued", "running"):
        SaeGroup.objects.filter(pk=job.pk).update(status=status)
        assert chat(token).status_code == 400, status  # authenticated, then the body is refused


@pytest.mark.parametrize("ended", ["completed", "failed", "cancelled"])
def test_a_job_token_ends_with_its_job(job, ended):
    token = job_token_for(job)
    SaeGroup.objects.filter(pk=job.pk).update(status=ended)
    response = chat(token)
    assert response.status_code == 401 and response.json()["error"]["code"] == "UNAUTHENTICATED"


def test_a_job_token_is_refused_when_its_job_is_gone_or_no_longer_its_owners(job, writer):
    token = job_token_for(job)
    SaeGroup.objects.filter(pk=job.pk).update(owner=None)
    assert chat(token).status_code == 401
    SaeGroup.objects.filter(pk=job.pk).update(owner=writer)
    assert chat(token).status_code == 400
    job.delete()
    assert chat(token).status_code == 401


def test_a_token_that_names_no_job_kind_is_refused(job, writer):
    """A token signed before tokens named their job's kind (valid for two days after its job) is
    refused, as is one naming a kind that does not exist."""
    for claims in ({"user": writer.pk, "job": job.pk}, {"user": writer.pk, "kind": "nothing", "job": job.pk}):
        token = JOB_TOKEN_PREFIX + signing.dumps(claims, salt=JOB_TOKEN_SALT, compress=True)
        assert chat(token).status_code == 401, claims
