"""REST API for datasets, extractions and activation caches: thin views over selectors and services."""

import io

from django.conf import settings
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.parsers import MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from activations import selectors, services
from activations.models import ActivationCache
from activations.serializers import (
    CacheOutputSerializer,
    CacheSliceOutputSerializer,
    CacheStatsOutputSerializer,
    CacheTopKOutputSerializer,
    DatasetOutputSerializer,
    DatasetSamplesOutputSerializer,
    ExtractionOutputSerializer,
    HookPointsOutputSerializer,
    TokenizeOutputSerializer,
)
from engine.datasets import FORMATS as DATASET_FORMATS
from mistudio.api_inputs import ARRAY_INDEX_MAX, DATABASE_INT_MAX
from mistudio.errors import ApplicationError
from mistudio.job_apis import JobApi
from mistudio.json_input import JSONParser
from mistudio.permissions import CanRead, CanWrite
from mistudio.serializers import StrictSerializer
from mistudio.streaming import ChunkedFileResponse, ChunkedStreamingResponse
from models_app.selectors import model_get


def upload_too_large(size: int) -> ApplicationError:
    limit = settings.DATASET_MAX_UPLOAD_BYTES
    return ApplicationError(
        "DATASET_TOO_LARGE",
        f"Uploads are limited to {limit} bytes.",
        status=413,
        details={"max_bytes": limit, "size_bytes": size},
    )


class DatasetListApi(APIView):
    """List datasets, or create one from an upload (multipart ``file``) or a local path (JSON)."""

    permission_classes = [CanWrite]
    parser_classes = [JSONParser, MultiPartParser]

    class InputSerializer(StrictSerializer):
        name = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")
        file = serializers.FileField(required=False)
        local_path = serializers.CharField(max_length=4096, required=False)
        format = serializers.ChoiceField(choices=list(DATASET_FORMATS), required=False)
        field = serializers.CharField(max_length=200, required=False)
        label_field = serializers.CharField(
            max_length=200, required=False,
            help_text="The JSONL key or CSV / Parquet column of each sample's class: a labelled dataset "
            "(sparse probing reads it)",
        )  # fmt: skip
        shared = serializers.BooleanField(default=False, help_text="Visible to every reader")

        def validate(self, attrs):
            if bool(attrs.get("file")) == bool(attrs.get("local_path")):
                raise serializers.ValidationError("Send either a file or a local_path.")
            return attrs

    @extend_schema(
        operation_id="api_datasets_list",
        responses=inline_serializer(
            "DatasetList",
            {"datasets": DatasetOutputSerializer(many=True), "total": serializers.IntegerField()},
        ),
    )
    def get(self, request):
        datasets = selectors.dataset_list(user=request.user)
        return Response(
            {"datasets": DatasetOutputSerializer(datasets, many=True).data, "total": datasets.count()}
        )

    @extend_schema(request=InputSerializer, responses={201: DatasetOutputSerializer})
    def post(self, request):
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
        if declared > settings.DATASET_MAX_UPLOAD_BYTES + 64 * 1024:  # refused before reading the body
            raise upload_too_large(declared)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        if values.get("file"):
            upload = values["file"]
            if upload.size > settings.DATASET_MAX_UPLOAD_BYTES:
                raise upload_too_large(upload.size)
            dataset = services.dataset_create_from_upload(
                name=values["name"],
                data=upload.read(),
                filename=upload.name,
                owner=request.user,
                format=values.get("format"),
                field=values.get("field"),
                shared=values["shared"],
                label_field=values.get("label_field"),
            )
        else:
            dataset = services.dataset_create_from_local(
                name=values["name"],
                path=values["local_path"],
                owner=request.user,
                format=values.get("format"),
                field=values.get("field"),
                shared=values["shared"],
                label_field=values.get("label_field"),
            )
        return Response(DatasetOutputSerializer(dataset).data, status=status.HTTP_201_CREATED)


class DatasetDetailApi(APIView):
    """One dataset; its owner (or an admin) may rename, share or delete it."""

    permission_classes = [CanWrite]

    class UpdateSerializer(StrictSerializer):
        name = serializers.CharField(required=False, max_length=500)
        shared = serializers.BooleanField(required=False)

    @extend_schema(responses=DatasetOutputSerializer)
    def get(self, request, dataset_id: str):
        return Response(
            DatasetOutputSerializer(selectors.dataset_get(user=request.user, dataset_id=dataset_id)).data
        )

    @extend_schema(request=UpdateSerializer, responses=DatasetOutputSerializer)
    def patch(self, request, dataset_id: str):
        selectors.dataset_get_to_change(user=request.user, dataset_id=dataset_id)
        data = self.UpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        dataset = services.dataset_update(dataset_id=dataset_id, actor=request.user, **data.validated_data)
        return Response(DatasetOutputSerializer(dataset).data)

    @extend_schema(responses={204: None})
    def delete(self, request, dataset_id: str):
        selectors.dataset_get_to_change(user=request.user, dataset_id=dataset_id)
        services.dataset_delete(dataset_id=dataset_id)
        return Response(status=status.HTTP_204_NO_CONTENT)


class DatasetSamplesApi(APIView):
    """Samples of a dataset, for previews (``offset``, ``limit`` ≤ 100)."""

    permission_classes = [CanRead]

    class FilterSerializer(serializers.Serializer):
        offset = serializers.IntegerField(min_value=0, max_value=DATABASE_INT_MAX, default=0)
        limit = serializers.IntegerField(min_value=1, max_value=100, default=20)

    @extend_schema(parameters=[FilterSerializer], responses={200: DatasetSamplesOutputSerializer})
    def get(self, request, dataset_id: str):
        dataset = selectors.dataset_get(user=request.user, dataset_id=dataset_id)
        page = self.FilterSerializer(data=request.query_params)
        page.is_valid(raise_exception=True)
        offset, limit = page.validated_data["offset"], page.validated_data["limit"]
        samples = services.dataset_samples(dataset, limit=offset + limit)[offset:]
        return Response(
            {"dataset_id": dataset.id, "offset": offset, "samples": samples, "total": dataset.sample_count}
        )


class HookPointsApi(APIView):
    """The model's hook points with their shapes (from its structure; no weights needed)."""

    permission_classes = [CanRead]

    @extend_schema(responses={200: HookPointsOutputSerializer})
    def get(self, request, model_id: str):
        model = model_get(user=request.user, model_id=model_id)
        return Response(selectors.hook_points(model))


class TokenizeApi(APIView):
    """``POST /api/models/{id}/tokenize``: how the model's tokenizer splits a few texts (its files,
    no load): the patching page's preview of prompts and one-token answers."""

    permission_classes = [CanRead]

    class InputSerializer(StrictSerializer):
        texts = serializers.ListField(
            child=serializers.CharField(
                max_length=selectors.MAX_TOKENIZE_CHARACTERS, allow_blank=True, trim_whitespace=False
            ),
            min_length=1,
            max_length=selectors.MAX_TOKENIZE_TEXTS,
        )
        special_tokens = serializers.BooleanField(
            default=True, help_text="Add them as a prompt gets them (false: as an answer token is read)"
        )

    @extend_schema(request=InputSerializer, responses={200: TokenizeOutputSerializer})
    def post(self, request, model_id: str):
        model = model_get(user=request.user, model_id=model_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        tokens = selectors.text_tokens(
            model, data.validated_data["texts"], special_tokens=data.validated_data["special_tokens"]
        )
        return Response({"tokens": tokens, "counts": [len(found) for found in tokens]})


# --- Extractions ------------------------------------------------------------------------------------


class ExtractActivationsApi(APIView):
    """Start an extraction: 202 ``{extraction_id, status: "queued", estimated_time_seconds}``, or 200
    with ``cached: true`` when a cache with the same key exists. A model that is not loaded is
    loaded first by the worker that takes the job."""

    permission_classes = [CanWrite]

    class InputSerializer(StrictSerializer):
        dataset_id = serializers.CharField(max_length=64)
        hooks = serializers.ListField(
            child=serializers.CharField(max_length=300), required=False, max_length=256
        )
        layer_indices = serializers.ListField(
            child=serializers.IntegerField(min_value=0, max_value=100_000), required=False, max_length=1024
        )
        sample_count = serializers.IntegerField(min_value=1, max_value=DATABASE_INT_MAX, required=False)
        batch_size = serializers.IntegerField(min_value=1, max_value=1024, default=16)
        # Omitted: 512 tokens, or the model's context when shorter.
        max_length = serializers.IntegerField(min_value=1, max_value=131072, required=False)
        # Omitted: the model's compute dtype (float32, or bfloat16/float16 for a half or quantized model).
        dtype = serializers.ChoiceField(choices=services.STORAGE_DTYPES, required=False)

    @extend_schema(request=InputSerializer, responses={202: ExtractionOutputSerializer})
    def post(self, request, model_id: str):
        model_get(user=request.user, model_id=model_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        selectors_dataset = selectors.dataset_get(user=request.user, dataset_id=values.pop("dataset_id"))
        job = services.extraction_request(
            model_id=model_id,
            dataset_id=selectors_dataset.id,
            owner=request.user,
            hooks=values.pop("hooks", None),
            layers=values.pop("layer_indices", None),
            **values,
        )
        body = {
            **ExtractionOutputSerializer(job).data,
            "estimated_time_seconds": selectors.extraction_estimate_seconds(job),
            "estimated_size_bytes": (
                job.cache.file_size_bytes if job.cached else services.cache_size_estimate(job)
            ),
            "message": "Using cached activations" if job.cached else "Activation extraction queued",
        }
        return Response(body, status=status.HTTP_200_OK if job.cached else status.HTTP_202_ACCEPTED)


class ExtractionListApi(APIView):
    permission_classes = [CanRead]

    @extend_schema(
        operation_id="api_extractions_list",
        responses=inline_serializer("ExtractionList", {"extractions": ExtractionOutputSerializer(many=True)}),
    )
    def get(self, request):
        jobs = selectors.extraction_list(user=request.user)[:200]
        return Response({"extractions": ExtractionOutputSerializer(jobs, many=True).data})


EXTRACTION_API = JobApi(
    route="extractions/<str:extraction_id>",
    name="extraction",
    component="Extraction",
    row="job",
    find=selectors.extraction_get,
    body=lambda job, request: ExtractionOutputSerializer(job).data,
    cancel=services.extraction_cancel,
    permission=CanRead,
    also=(("models/<str:model_id>/activations/<str:extraction_id>", "model-extraction-detail"),),
    response=ExtractionOutputSerializer,
)


# --- Caches -----------------------------------------------------------------------------------------


class CacheListApi(APIView):
    permission_classes = [CanRead]

    class FilterSerializer(serializers.Serializer):
        model = serializers.CharField(required=False, max_length=64)
        dataset = serializers.CharField(required=False, max_length=64)
        status = serializers.ChoiceField(choices=ActivationCache.Status.choices, required=False)

    @extend_schema(
        operation_id="api_activation_caches_list",
        parameters=[FilterSerializer],
        responses=inline_serializer(
            "CacheList", {"caches": CacheOutputSerializer(many=True), "total": serializers.IntegerField()}
        ),
    )
    def get(self, request):
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        caches = selectors.cache_list(user=request.user, filters=filters.validated_data)
        return Response({"caches": CacheOutputSerializer(caches, many=True).data, "total": caches.count()})


class CacheDetailApi(APIView):
    permission_classes = [CanWrite]

    @extend_schema(responses=CacheOutputSerializer)
    def get(self, request, cache_id: str):
        cache = selectors.cache_get(user=request.user, cache_id=cache_id)
        return Response(
            {
                **CacheOutputSerializer(cache).data,
                "manifest": selectors.cache_manifest(cache, user=request.user),
            }
        )

    @extend_schema(responses={204: None})
    def delete(self, request, cache_id: str):
        selectors.cache_get_to_change(user=request.user, cache_id=cache_id)
        services.cache_delete(cache_id=cache_id)
        return Response(status=status.HTTP_204_NO_CONTENT)


class CacheDownloadApi(APIView):
    """The whole cache as a streamed tar archive, or one file of it (``?file=<path in the manifest>``)."""

    permission_classes = [CanRead]

    @extend_schema(responses={(200, "application/x-tar"): bytes})
    def get(self, request, cache_id: str):
        cache = selectors.completed_cache(user=request.user, cache_id=cache_id)
        services.cache_touch(cache, lease_seconds=3600)
        wanted = request.query_params.get("file")
        manifest = selectors.cache_manifest_bytes(cache, user=request.user)
        if wanted:
            path = selectors.cache_file(cache, wanted)
            name = f"{cache.id}-{path.name}"
            if wanted == selectors.MANIFEST_FILE:
                return ChunkedFileResponse(io.BytesIO(manifest), as_attachment=True, filename=name)
            return ChunkedFileResponse(open(path, "rb"), as_attachment=True, filename=name)
        archive = selectors.cache_tar_stream(cache, manifest=manifest)
        response = ChunkedStreamingResponse(archive, content_type="application/x-tar")
        response["Content-Disposition"] = f'attachment; filename="{cache.id}.tar"'
        return response


class CacheSliceApi(APIView):
    """Rows ``[start, stop)`` of one hook: JSON, ``.npy`` or ``.safetensors`` bytes (``output=``)."""

    permission_classes = [CanRead]

    class QuerySerializer(serializers.Serializer):
        hook = serializers.CharField(max_length=300)
        start = serializers.IntegerField(min_value=0, max_value=ARRAY_INDEX_MAX, default=0)
        stop = serializers.IntegerField(min_value=1, max_value=ARRAY_INDEX_MAX, required=False)
        # Not "format": DRF reserves that query parameter for choosing a renderer.
        output = serializers.ChoiceField(choices=selectors.SLICE_OUTPUTS, default="json")

    @extend_schema(
        parameters=[QuerySerializer],
        responses={
            (200, "application/json"): CacheSliceOutputSerializer,
            (200, "application/octet-stream"): bytes,
        },
    )
    def get(self, request, cache_id: str):
        cache = selectors.completed_cache(user=request.user, cache_id=cache_id)
        query = self.QuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        values = query.validated_data
        array, stop = selectors.cache_slice(
            cache, hook=values["hook"], start=values["start"], stop=values.get("stop")
        )
        services.cache_touch(cache)
        if values["output"] == "json":
            # Streamed, a block of rows at a time encoded off the thread other views share.
            header = {
                "hook": values["hook"],
                "start": values["start"],
                "stop": stop,
                "shape": list(array.shape),
            }
            return ChunkedStreamingResponse(
                selectors.json_rows(header, array), content_type="application/json"
            )
        content = io.BytesIO(selectors.array_file_bytes(array, values["output"]))
        response = ChunkedFileResponse(content, content_type="application/octet-stream", as_attachment=True)
        response["Content-Disposition"] = (
            f'attachment; filename="{cache.id}-{values["start"]}-{stop}.{values["output"]}"'
        )
        return response


class CacheStatsApi(APIView):
    """Per-neuron mean / std / max / min and the mean token norm, for each hook (or one)."""

    permission_classes = [CanRead]

    @extend_schema(responses={200: CacheStatsOutputSerializer})
    def get(self, request, cache_id: str):
        cache = selectors.completed_cache(user=request.user, cache_id=cache_id)
        services.cache_touch(cache)
        return Response(selectors.cache_stats(cache, request.query_params.get("hook")))


class CacheTopKApi(APIView):
    """The top-k activating tokens of one neuron, with their context, decoded."""

    permission_classes = [CanRead]

    class QuerySerializer(serializers.Serializer):
        hook = serializers.CharField(max_length=300)
        neuron = serializers.IntegerField(min_value=0, max_value=DATABASE_INT_MAX)
        k = serializers.IntegerField(min_value=1, max_value=200, default=20)
        context = serializers.IntegerField(min_value=0, max_value=64, default=8)

    @extend_schema(parameters=[QuerySerializer], responses={200: CacheTopKOutputSerializer})
    def get(self, request, cache_id: str):
        cache = selectors.completed_cache(user=request.user, cache_id=cache_id)
        query = self.QuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        services.cache_touch(cache)
        return Response(selectors.cache_top_k(cache, **query.validated_data))
