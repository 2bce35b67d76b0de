"""REST API for models: thin views over selectors and services."""

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from models_app import selectors, services
from models_app.models import LanguageModel
from models_app.permissions import CanRead, CanWrite


class ModelOutputSerializer(serializers.ModelSerializer):
    class Meta:
        model = LanguageModel
        fields = [
            "id", "name", "model_type", "architecture", "source", "identifier", "revision", "config",
            "quantization", "status", "progress", "status_message", "memory_usage_bytes",
            "load_time_seconds", "parameter_count", "hidden_size", "num_layers", "vocab_size",
            "host_worker", "error_code", "error_message", "created_at", "loaded_at", "last_used_at",
            "updated_at",
        ]  # fmt: skip


class ModelListApi(APIView):
    permission_classes = [CanRead]

    class FilterSerializer(serializers.Serializer):
        status = serializers.ChoiceField(choices=LanguageModel.Status.choices, required=False)
        model_type = serializers.CharField(required=False, max_length=100)
        limit = serializers.IntegerField(required=False, min_value=1, max_value=500, default=50)
        offset = serializers.IntegerField(required=False, min_value=0, default=0)

    @extend_schema(parameters=[FilterSerializer], responses=ModelOutputSerializer(many=True))
    def get(self, request):
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        query = selectors.model_list(user=request.user)
        for field in ("status", "model_type"):
            if field in filters.validated_data:
                query = query.filter(**{field: filters.validated_data[field]})
        limit, offset = filters.validated_data["limit"], filters.validated_data["offset"]
        return Response(
            {
                "models": ModelOutputSerializer(query[offset : offset + limit], many=True).data,
                "total": query.count(),
                "limit": limit,
                "offset": offset,
            }
        )


class ModelDetailApi(APIView):
    permission_classes = [CanRead]

    @extend_schema(responses=ModelOutputSerializer)
    def get(self, request, model_id: str):
        return Response(ModelOutputSerializer(selectors.model_get(user=request.user, model_id=model_id)).data)


class ModelLoadApi(APIView):
    """Queue a load. Answers 202; progress follows as ``model:loading`` events on ``model.<id>``."""

    permission_classes = [CanWrite]

    class InputSerializer(serializers.Serializer):
        quantization = serializers.ChoiceField(choices=LanguageModel.Quantization.choices, required=False)

    @extend_schema(request=InputSerializer, responses={202: ModelOutputSerializer})
    def post(self, request, model_id: str):
        selectors.model_get(user=request.user, model_id=model_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        model = services.model_load_request(
            model_id=model_id, quantization=data.validated_data.get("quantization")
        )
        return Response(ModelOutputSerializer(model).data, status=status.HTTP_202_ACCEPTED)


class ModelUnloadApi(APIView):
    permission_classes = [CanWrite]

    @extend_schema(request=None, responses={202: ModelOutputSerializer})
    def post(self, request, model_id: str):
        selectors.model_get(user=request.user, model_id=model_id)
        model = services.model_unload_request(model_id=model_id)
        return Response(ModelOutputSerializer(model).data, status=status.HTTP_202_ACCEPTED)


class WorkerListApi(APIView):
    """Live workers, from their heartbeats."""

    permission_classes = [CanRead]

    @extend_schema(responses={200: dict})
    def get(self, request):
        from models_app.workers import read_heartbeats

        return Response({"workers": read_heartbeats()})
