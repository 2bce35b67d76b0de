"""The admin lists datasets, extraction jobs and caches, and deletes through the services."""

import pytest

from activations.models import Dataset
from activations.services import dataset_create_from_texts

pytestmark = pytest.mark.django_db


def test_admin_pages_list_datasets_jobs_and_caches(admin_client):
    dataset = dataset_create_from_texts(
        name="admin-ds", texts=["a", "b"], owner=None, source=Dataset.Source.BUILTIN
    )
    for page in ("dataset", "extractionjob", "activationcache"):
        assert admin_client.get(f"/admin/activations/{page}/").status_code == 200
    assert "admin-ds" in admin_client.get("/admin/activations/dataset/").content.decode()
    assert (
        "/admin/activations/dataset/add/"
        not in admin_client.get("/admin/activations/dataset/").content.decode()
    )
    path = dataset.storage_path
    admin_client.post(f"/admin/activations/dataset/{dataset.id}/delete/", {"post": "yes"})
    assert not Dataset.objects.filter(pk=dataset.id).exists() and not path.exists()
