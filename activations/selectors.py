"""Read queries for datasets."""

from django.db.models import QuerySet

from activations.models import Dataset
from mistudio.errors import ApplicationError
from models_app import roles


def dataset_list(*, user) -> QuerySet[Dataset]:
    if not user.has_perm(roles.READ):
        return Dataset.objects.none()
    return Dataset.objects.all()


def dataset_get(*, user, dataset_id: str) -> Dataset:
    dataset = dataset_list(user=user).filter(pk=dataset_id).first()
    if dataset is None:
        raise ApplicationError("DATASET_NOT_FOUND", "No such dataset.", status=404)
    return dataset
