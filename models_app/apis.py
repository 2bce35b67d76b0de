"""REST API for models: thin views over selectors and services."""

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from mistudio.api_inputs import DATABASE_INT_MAX
from mistudio.permissions import CanRead, CanWrite
from mistudio.serializers import StrictSerializer
from mistudio.throttling import ModelLoadThrottle, ModelRegisterThrottle
from models_app import selectors, services
from models_app.models import LanguageModel
from models_app.serializers import (
    MemoryReportOutputSerializer,
    ModelOutputSerializer,
    WorkerOverviewOutputSerializer,
)

MAX_KEEP_ALIVE_SECONDS = 30 * 24 * 3600


class ModelListApi(APIView):
    """List models (filters, search, pagination) or register one."""

    permission_classes = [CanWrite]
    throttle_classes = [ModelRegisterThrottle]  # only a registration with auto_load counts

    class FilterSerializer(serializers.Serializer):
        status = serializers.ChoiceField(choices=LanguageModel.Status.choices, required=False)
        model_type = serializers.CharField(required=False, max_length=100)
        source = serializers.ChoiceField(choices=LanguageModel.Source.choices, required=False)
        quantization = serializers.ChoiceField(choices=LanguageModel.Quantization.choices, required=False)
        search = serializers.CharField(required=False, max_length=200)
        limit = serializers.IntegerField(required=False, min_value=1, max_value=500, default=50)
        offset = serializers.IntegerField(required=False, min_value=0, max_value=DATABASE_INT_MAX, default=0)

    class InputSerializer(StrictSerializer):
        name = serializers.CharField(required=False, max_length=500, allow_blank=True, default="")
        source = serializers.ChoiceField(
            choices=LanguageModel.Source.choices, default=LanguageModel.Source.HUGGINGFACE
        )
        model_identifier = serializers.CharField(max_length=1000)
        revision = serializers.CharField(required=False, max_length=255, allow_blank=True, default="")
        model_type = serializers.CharField(required=False, max_length=100, allow_blank=True, default="")
        quantization = serializers.ChoiceField(
            choices=LanguageModel.Quantization.choices, default=LanguageModel.Quantization.NONE
        )
        auto_load = serializers.BooleanField(default=False)
        pinned = serializers.BooleanField(default=False)
        shared = serializers.BooleanField(default=False, help_text="Visible to every reader")
        keep_alive_seconds = serializers.IntegerField(
            required=False, allow_null=True, min_value=1, max_value=MAX_KEEP_ALIVE_SECONDS, default=None
        )

    @extend_schema(
        operation_id="api_models_list",
        parameters=[FilterSerializer],
        responses=inline_serializer(
            "ModelPage",
            {
                "models": ModelOutputSerializer(many=True),
                "total": serializers.IntegerField(),
                "limit": serializers.IntegerField(),
                "offset": serializers.IntegerField(),
            },
        ),
    )
    def get(self, request):
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        query = selectors.model_list(user=request.user, filters=filters.validated_data)
        limit, offset = filters.validated_data["limit"], filters.validated_data["offset"]
        return Response(
            {
                "models": ModelOutputSerializer(query[offset : offset + limit], many=True).data,
                "total": query.count(),
                "limit": limit,
                "offset": offset,
            }
        )

    @extend_schema(request=InputSerializer, responses={201: ModelOutputSerializer})
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        fields = dict(data.validated_data)
        model = services.model_register(
            identifier=fields.pop("model_identifier"), owner=request.user, **fields
        )
        return Response(ModelOutputSerializer(model).data, status=status.HTTP_201_CREATED)


class ModelDetailApi(APIView):
    permission_classes = [CanWrite]

    class UpdateSerializer(StrictSerializer):
        name = serializers.CharField(required=False, max_length=500)
        pinned = serializers.BooleanField(required=False)
        shared = serializers.BooleanField(required=False)
        keep_alive_seconds = serializers.IntegerField(
            required=False, allow_null=True, min_value=1, max_value=MAX_KEEP_ALIVE_SECONDS
        )
        quantization = serializers.ChoiceField(choices=LanguageModel.Quantization.choices, required=False)

    @extend_schema(responses=ModelOutputSerializer)
    def get(self, request, model_id: str):
        return Response(ModelOutputSerializer(selectors.model_get(user=request.user, model_id=model_id)).data)

    @extend_schema(request=UpdateSerializer, responses=ModelOutputSerializer)
    def patch(self, request, model_id: str):
        selectors.model_get_to_change(user=request.user, model_id=model_id)
        data = self.UpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        model = services.model_update(model_id=model_id, actor=request.user, **data.validated_data)
        return Response(ModelOutputSerializer(model).data)

    @extend_schema(responses={204: None})
    def delete(self, request, model_id: str):
        selectors.model_get_to_change(user=request.user, model_id=model_id)
        services.model_delete(model_id=model_id)
        return Response(status=status.HTTP_204_NO_CONTENT)


class ModelLoadApi(APIView):
    """Queue a load: 202 with the job id; progress follows as ``model:loading`` events on ``model.<id>``.

    A second request while one is in flight gets 409 ``ALREADY_LOADING``; more than
    ``RATE_LIMIT_MODEL_LOADS_PER_HOUR`` requests by one user in an hour get 429 ``RATE_LIMITED``.
    """

    permission_classes = [CanWrite]
    throttle_classes = [ModelLoadThrottle]

    class InputSerializer(StrictSerializer):
        quantization = serializers.ChoiceField(choices=LanguageModel.Quantization.choices, required=False)

    @extend_schema(request=InputSerializer, responses={202: ModelOutputSerializer})
    def post(self, request, model_id: str):
        selectors.model_get(user=request.user, model_id=model_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        model = services.model_load_request(
            model_id=model_id, actor=request.user, quantization=data.validated_data.get("quantization")
        )
        body = {
            **ModelOutputSerializer(model).data,
            "job_id": model.rq_job_id,
            "message": "Model loading initiated",
        }
        return Response(body, status=status.HTTP_202_ACCEPTED)


class ModelUnloadApi(APIView):
    permission_classes = [CanWrite]

    @extend_schema(request=None, responses={202: ModelOutputSerializer})
    def post(self, request, model_id: str):
        selectors.model_get_to_change(user=request.user, model_id=model_id)
        model = services.model_unload_request(model_id=model_id)
        return Response(ModelOutputSerializer(model).data, status=status.HTTP_202_ACCEPTED)


class ModelCancelLoadApi(APIView):
    """Cancel a load (queued, or downloading / between stages)."""

    permission_classes = [CanWrite]

    @extend_schema(request=None, responses={202: ModelOutputSerializer})
    def post(self, request, model_id: str):
        selectors.model_get_to_change(user=request.user, model_id=model_id)
        model = services.model_cancel_load(model_id=model_id)
        return Response(ModelOutputSerializer(model).data, status=status.HTTP_202_ACCEPTED)


class ModelMemoryEstimateApi(APIView):
    permission_classes = [CanRead]

    @extend_schema(responses={200: MemoryReportOutputSerializer})
    def get(self, request, model_id: str):
        model = selectors.model_get(user=request.user, model_id=model_id)
        return Response(selectors.model_memory_report(model))


class WorkerListApi(APIView):
    """Live workers (from their heartbeats, loaded models named), queue lengths, Redis and database
    status. An unreachable Redis is reported (``redis.ok`` false), not raised."""

    permission_classes = [CanRead]

    @extend_schema(responses={200: WorkerOverviewOutputSerializer})
    def get(self, request):
        return Response(selectors.worker_overview(user=request.user))
