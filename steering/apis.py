"""REST API for steering vectors (thin views)."""

from django.http import HttpResponse
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.parsers import MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from activations.selectors import dataset_get
from generation.services import generation_model
from mistudio.job_apis import JobApi
from mistudio.json_input import JSONParser as MistudioJSONParser
from mistudio.permissions import CanRead, CanWrite
from mistudio.serializers import StrictSerializer
from mistudio.throttling import WorkerCallThrottle
from steering import selectors, services
from steering.models import SteeringVector
from steering.serializers import (
    LogitLensOutputSerializer,
    PatchingOutputSerializer,
    VectorListOutputSerializer,
    VectorOutputSerializer,
    vector_state,
)

MAX_IMPORT_BYTES = 64 * 1024 * 1024


class VectorListApi(APIView):
    """The steering vectors you can see, or compute one from two prompt lists (202)."""

    permission_classes = [CanWrite]

    class FilterSerializer(StrictSerializer):
        model_id = serializers.CharField(max_length=64, required=False)

    class InputSerializer(StrictSerializer):
        model_id = serializers.CharField(max_length=500)
        hook_name = serializers.CharField(max_length=300)
        positive = serializers.ListField(child=serializers.CharField(trim_whitespace=False), required=False)
        negative = serializers.ListField(child=serializers.CharField(trim_whitespace=False), required=False)
        positive_dataset_id = serializers.CharField(max_length=64, required=False)
        negative_dataset_id = serializers.CharField(max_length=64, required=False)
        reduction = serializers.ChoiceField(choices=SteeringVector.Reduction.values, default="mean")
        name = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")
        shared = serializers.BooleanField(default=False)

    @extend_schema(
        operation_id="api_steering_vectors_list",
        parameters=[FilterSerializer],
        responses={200: VectorListOutputSerializer},
    )
    def get(self, request):
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        vectors = selectors.vector_list(user=request.user, model_id=filters.validated_data.get("model_id"))
        rows = [vector_state(row, viewer=request.user, with_prompts=False) for row in vectors[:500]]
        return Response({"vectors": rows, "total": vectors.count()})

    @extend_schema(request=InputSerializer, responses={202: VectorOutputSerializer})
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        model = generation_model(user=request.user, model_ref=values.pop("model_id"))
        for side in ("positive", "negative"):
            dataset_id = values.pop(f"{side}_dataset_id", None)
            if dataset_id is not None:
                values[f"{side}_dataset"] = dataset_get(user=request.user, dataset_id=dataset_id)
        vector = services.vector_request(owner=request.user, model=model, **values)
        return Response(vector_state(vector, viewer=request.user), status=status.HTTP_202_ACCEPTED)


class VectorImportApi(APIView):
    """Import a vector from a safetensors file (multipart: ``file``, ``model_id``, ``hook_name``)."""

    permission_classes = [CanWrite]
    # Multipart carries the file; JSON is parsed too, so a JSON body gets the same 400s as elsewhere.
    parser_classes = [MultiPartParser, MistudioJSONParser]

    class InputSerializer(StrictSerializer):
        file = serializers.FileField()
        model_id = serializers.CharField(max_length=500)
        hook_name = serializers.CharField(max_length=300)
        name = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")
        shared = serializers.BooleanField(default=False)

    @extend_schema(request=InputSerializer, responses={201: VectorOutputSerializer})
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        upload = values.pop("file")
        if upload.size > MAX_IMPORT_BYTES:
            return Response(
                {"error": {"code": "FILE_TOO_LARGE", "message": "At most 64 MiB.", "details": {}}}, status=413
            )
        model = generation_model(user=request.user, model_ref=values.pop("model_id"))
        vector = services.vector_import(owner=request.user, model=model, data=upload.read(), **values)
        return Response(vector_state(vector, viewer=request.user), status=status.HTTP_201_CREATED)


VECTOR_API = JobApi(
    route="steering-vectors/<str:vector_id>",
    name="steering-vector",
    component="Vector",
    row="vector",
    find=selectors.vector_get,
    body=lambda vector, request: vector_state(vector, viewer=request.user),
    update=services.vector_update,
    update_fields={
        "name": serializers.CharField(max_length=500, required=False, allow_blank=True),
        "shared": serializers.BooleanField(required=False),
    },
    delete=services.vector_delete,
    cancel=services.vector_cancel,
    cancel_doc="Cancel a vector being computed (its owner or an admin).",
)


class VectorExportApi(APIView):
    """The vector's safetensors file (one tensor, ``vector``; its hook in the metadata)."""

    permission_classes = [CanRead]

    @extend_schema(responses={(200, "application/octet-stream"): bytes})
    def get(self, request, vector_id: str):
        vector = selectors.completed_vector(user=request.user, vector_id=vector_id)
        response = HttpResponse(vector.path.read_bytes(), content_type="application/octet-stream")
        response["Content-Disposition"] = f'attachment; filename="{vector.id}.safetensors"'
        return response


class PatchingApi(APIView):
    """Activation patching: the metric grid over hook points x positions (the model's worker runs it)."""

    permission_classes = [CanWrite]
    throttle_classes = [WorkerCallThrottle]

    class InputSerializer(StrictSerializer):
        clean = serializers.CharField(max_length=4000, trim_whitespace=False)
        corrupted = serializers.CharField(max_length=4000, trim_whitespace=False)
        answer = serializers.CharField(max_length=200, trim_whitespace=False)
        wrong_answer = serializers.CharField(max_length=200, trim_whitespace=False)
        hooks = serializers.ListField(
            child=serializers.CharField(max_length=300), required=False, max_length=128
        )

    @extend_schema(request=InputSerializer, responses={200: PatchingOutputSerializer})
    def post(self, request, model_id: str):
        model = generation_model(user=request.user, model_ref=model_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        return Response(services.patching_request(model=model, actor=request.user, **data.validated_data))


class LogitLensApi(APIView):
    """The logit lens: top next-token predictions after every block at every position."""

    permission_classes = [CanWrite]
    throttle_classes = [WorkerCallThrottle]

    class InputSerializer(StrictSerializer):
        prompt = serializers.CharField(max_length=4000, trim_whitespace=False)
        top = serializers.IntegerField(min_value=1, max_value=20, default=5)

    @extend_schema(request=InputSerializer, responses={200: LogitLensOutputSerializer})
    def post(self, request, model_id: str):
        model = generation_model(user=request.user, model_ref=model_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        return Response(services.logit_lens_request(model=model, actor=request.user, **data.validated_data))
