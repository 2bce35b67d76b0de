"""REST API for datasets (read side; uploads come with the dataset work)."""

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from activations import selectors
from activations.models import Dataset
from models_app.permissions import CanRead


class DatasetOutputSerializer(serializers.ModelSerializer):
    class Meta:
        model = Dataset
        fields = [
            "id",
            "name",
            "source",
            "original_name",
            "sample_count",
            "size_bytes",
            "content_hash",
            "created_at",
        ]


class DatasetListApi(APIView):
    permission_classes = [CanRead]

    @extend_schema(responses=DatasetOutputSerializer(many=True))
    def get(self, request):
        datasets = selectors.dataset_list(user=request.user)
        return Response(
            {"datasets": DatasetOutputSerializer(datasets, many=True).data, "total": datasets.count()}
        )


class DatasetDetailApi(APIView):
    permission_classes = [CanRead]

    @extend_schema(responses=DatasetOutputSerializer)
    def get(self, request, dataset_id: str):
        return Response(
            DatasetOutputSerializer(selectors.dataset_get(user=request.user, dataset_id=dataset_id)).data
        )
