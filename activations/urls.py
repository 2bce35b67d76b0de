from django.urls import path

from activations import apis

urlpatterns = [
    path("datasets", apis.DatasetListApi.as_view(), name="dataset-list"),
    path("datasets/<str:dataset_id>", apis.DatasetDetailApi.as_view(), name="dataset-detail"),
]
