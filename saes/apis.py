"""REST API for sparse autoencoders: thin views over selectors and services."""

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.parsers import MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from activations.selectors import completed_cache, dataset_get
from mistudio.job_apis import JobApi
from mistudio.permissions import CanRead, CanWrite
from mistudio.serializers import StrictSerializer
from mistudio.streaming import ChunkedStreamingResponse
from models_app.selectors import model_get
from saes import groups, selectors, services
from saes.models import ARCHITECTURES, SaeGroup, SparseAutoencoder
from saes.serializers import (
    SaeEvaluationStartedOutputSerializer,
    SaeGroupListOutputSerializer,
    SaeGroupOutputSerializer,
    SaeListOutputSerializer,
    SaeOutputSerializer,
    TranscoderSerializer,
    TranscoderSetOutputSerializer,
    VariantSerializer,
    group_request,
    sae_group_state,
    sae_state,
)


def sae_body(sae: SparseAutoencoder, request, *, with_history: bool = True) -> dict:
    return sae_state(sae, viewer=request.user, with_history=with_history)


class SaeListApi(APIView):
    """List SAEs, or start training one on an activation cache (202)."""

    permission_classes = [CanWrite]

    class FilterSerializer(serializers.Serializer):
        model = serializers.CharField(required=False, max_length=64)
        cache = serializers.CharField(required=False, max_length=64)
        hook = serializers.CharField(required=False, max_length=300)
        status = serializers.ChoiceField(choices=SparseAutoencoder.Status.choices, required=False)

    class TrainSerializer(StrictSerializer):
        cache_id = serializers.CharField(max_length=64)
        hook = serializers.CharField(max_length=300)
        architecture = serializers.ChoiceField(choices=ARCHITECTURES, default="topk")
        expansion_factor = serializers.IntegerField(min_value=1, max_value=1024, required=False)
        d_sae = serializers.IntegerField(min_value=1, max_value=2**24, required=False)
        k = serializers.IntegerField(min_value=1, max_value=2**16, required=False)
        l1_coefficient = serializers.FloatField(min_value=0, max_value=1e6, required=False)
        l0_coefficient = serializers.FloatField(min_value=0, max_value=1e6, required=False)
        lr = serializers.FloatField(min_value=1e-8, max_value=1.0, default=3e-4)
        batch_size = serializers.IntegerField(min_value=1, max_value=65536, default=4096)
        total_tokens = serializers.IntegerField(min_value=1, max_value=10**12, required=False)
        b_dec_init = serializers.ChoiceField(choices=services.B_DEC_INITS, default="geometric_median")
        dead_after_steps = serializers.IntegerField(min_value=1, max_value=10**9, required=False)
        name = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")
        shared = serializers.BooleanField(default=False)

    @extend_schema(
        operation_id="api_saes_list",
        parameters=[FilterSerializer],
        responses=SaeListOutputSerializer,
    )
    def get(self, request):
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        saes = selectors.sae_list(user=request.user, filters=filters.validated_data)
        return Response(
            {
                "saes": [sae_body(sae, request, with_history=False) for sae in saes[:500]],
                "total": saes.count(),
            }
        )

    @extend_schema(request=TrainSerializer, responses={202: SaeOutputSerializer})
    def post(self, request):
        data = self.TrainSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        cache = completed_cache(user=request.user, cache_id=values.pop("cache_id"))
        sae = services.sae_train_request(owner=request.user, cache=cache, **values)
        return Response(sae_body(sae, request), status=status.HTTP_202_ACCEPTED)


SAE_API = JobApi(
    route="saes/<str:sae_id>",
    name="sae",
    component="Sae",
    row="sae",
    find=selectors.sae_get,
    find_to_change=selectors.sae_get_to_change,
    body=sae_body,
    update=services.sae_update,
    update_fields={
        "name": serializers.CharField(required=False, max_length=500),
        "shared": serializers.BooleanField(required=False),
    },
    delete=services.sae_delete,
    cancel=services.sae_cancel,
    doc="One SAE with its metrics and training curves; its owner may rename, share or delete it.",
)


class SaeEvaluateApi(APIView):
    """Evaluate on the held-out part of a cache (default: the training cache), with CE loss recovered."""

    permission_classes = [CanWrite]

    class InputSerializer(StrictSerializer):
        cache_id = serializers.CharField(max_length=64, required=False)

    @extend_schema(request=InputSerializer, responses={202: SaeEvaluationStartedOutputSerializer})
    def post(self, request, sae_id: str):
        sae = selectors.sae_get_to_change(user=request.user, sae_id=sae_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        cache_id = data.validated_data.get("cache_id")
        cache = completed_cache(user=request.user, cache_id=cache_id) if cache_id else None
        evaluation = services.sae_evaluate_request(sae=sae, actor=request.user, cache=cache)
        sae.refresh_from_db()
        return Response(
            {**sae_body(sae, request), "evaluation_id": evaluation.id}, status=status.HTTP_202_ACCEPTED
        )


class SaeGroupStopApi(APIView):
    """Stop a group early and keep it (202): training ends at its next step and each member is
    evaluated and saved from what it has learnt; a queued group is cancelled."""

    permission_classes = [CanWrite]

    class InputSerializer(StrictSerializer):
        """No fields: an empty body (anything else is refused, malformed JSON with a 400)."""

    @extend_schema(request=InputSerializer, responses={202: SaeGroupOutputSerializer})
    def post(self, request, group_id: str):
        self.InputSerializer(data=request.data).is_valid(raise_exception=True)
        group = selectors.group_get(user=request.user, group_id=group_id)
        group = groups.sae_group_stop(group=group, actor=request.user)
        return Response(sae_group_state(group, viewer=request.user), status=status.HTTP_202_ACCEPTED)


class SaeImportApi(APIView):
    """Import a SAELens folder or a Gemma Scope ``params.npz`` from a folder under LOCAL_MODEL_ROOTS:
    202 with the queued SAE (a worker reads its arrays), or 200 with your earlier import of the
    same files."""

    permission_classes = [CanWrite]

    class InputSerializer(StrictSerializer):
        local_path = serializers.CharField(max_length=4096)
        format = serializers.ChoiceField(choices=["auto", "saelens", "gemma_scope"], default="auto")
        model_id = serializers.CharField(max_length=64, required=False)
        hook = serializers.CharField(max_length=300, required=False)
        name = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")
        shared = serializers.BooleanField(default=False)

    @extend_schema(request=InputSerializer, responses={202: SaeOutputSerializer, 200: SaeOutputSerializer})
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        model_id = values.pop("model_id", None)
        model = model_get(user=request.user, model_id=model_id) if model_id else None
        sae, created = services.sae_import(owner=request.user, model=model, **values)
        answer = status.HTTP_202_ACCEPTED if created else status.HTTP_200_OK
        return Response(sae_body(sae, request), status=answer)


class SaeUploadApi(APIView):
    """Import a SAELens folder sent in the request (multipart: ``cfg`` = its ``cfg.json``,
    ``weights`` = ``sae_weights.safetensors``, optionally ``sparsity``), checked as a local folder
    is: 202 with the queued SAE, or 200 with your earlier import of the same files."""

    permission_classes = [CanWrite]
    parser_classes = [MultiPartParser]

    class InputSerializer(StrictSerializer):
        cfg = serializers.FileField()
        weights = serializers.FileField()
        sparsity = serializers.FileField(required=False)
        model_id = serializers.CharField(max_length=64, required=False)
        hook = serializers.CharField(max_length=300, required=False)
        name = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")
        shared = serializers.BooleanField(default=False)

    @extend_schema(
        request={"multipart/form-data": InputSerializer},
        responses={202: SaeOutputSerializer, 200: SaeOutputSerializer},
    )
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        files = {field: values.pop(field) for field in services.UPLOAD_FILES if field in values}
        model_id = values.pop("model_id", None)
        model = model_get(user=request.user, model_id=model_id) if model_id else None
        sae, created = services.sae_upload(owner=request.user, files=files, model=model, **values)
        answer = status.HTTP_202_ACCEPTED if created else status.HTTP_200_OK
        return Response(sae_body(sae, request), status=answer)


class TranscoderSetImportApi(APIView):
    """Import a circuit-tracer transcoder set (``layer_{i}.safetensors`` per layer, and optionally its
    ``config.yaml``) from a folder under LOCAL_MODEL_ROOTS as one transcoder per layer of the model,
    or a cross-layer transcoder (``W_enc_{l}``/``W_dec_{l}.safetensors``) as one row over every
    layer: 202 with the queued rows (a worker reads the files), or 200 with your earlier import."""

    permission_classes = [CanWrite]

    class InputSerializer(StrictSerializer):
        local_path = serializers.CharField(max_length=4096)
        model_id = serializers.CharField(max_length=64)
        name = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")
        shared = serializers.BooleanField(default=False)

    @extend_schema(
        request=InputSerializer,
        responses={202: TranscoderSetOutputSerializer, 200: TranscoderSetOutputSerializer},
    )
    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        model = model_get(user=request.user, model_id=values.pop("model_id"))
        saes, created = services.transcoder_set_import(owner=request.user, model=model, **values)
        answer = status.HTTP_202_ACCEPTED if created else status.HTTP_200_OK
        return Response({"saes": [sae_body(sae, request) for sae in saes]}, status=answer)


class SaeExportApi(APIView):
    """The SAE as a tar of its SAELens folder (``cfg.json``, ``sae_weights.safetensors``, …)."""

    permission_classes = [CanRead]

    @extend_schema(responses={(200, "application/x-tar"): bytes})
    def get(self, request, sae_id: str):
        sae = selectors.completed_sae(user=request.user, sae_id=sae_id)
        response = ChunkedStreamingResponse(
            selectors.sae_export_stream(sae, user=request.user), content_type="application/x-tar"
        )
        response["Content-Disposition"] = f'attachment; filename="{sae.id}.tar"'
        return response


# --- groups: training from the model ----------------------------------------------------------------


class SaeGroupListApi(APIView):
    """List SAE groups, or start one (202): SAEs and transcoders trained straight from a model
    over a dataset, one forward pass feeding them all."""

    permission_classes = [CanWrite]

    class TrainSerializer(VariantSerializer):
        model_id = serializers.CharField(max_length=64)
        dataset_id = serializers.CharField(max_length=64)
        hooks = serializers.ListField(
            child=serializers.CharField(max_length=300), max_length=groups.MAX_GROUP_MEMBERS, default=list
        )
        transcoders = serializers.ListField(
            child=TranscoderSerializer(), max_length=groups.MAX_GROUP_MEMBERS, default=list
        )
        variants = serializers.ListField(
            child=VariantSerializer(), max_length=groups.MAX_GROUP_MEMBERS, default=list
        )
        cross_layer_transcoder = serializers.BooleanField(
            default=False,
            help_text="Also train one cross-layer transcoder over every layer (TopK with k; JumpReLU with "
            "the tanh penalty when the architecture is jumprelu)",
        )
        batch_size = serializers.IntegerField(min_value=1, max_value=65536, default=4096)
        total_tokens = serializers.IntegerField(min_value=1, max_value=10**12, required=False)
        max_length = serializers.IntegerField(min_value=2, max_value=2**20, required=False)
        b_dec_init = serializers.ChoiceField(choices=services.B_DEC_INITS, default="geometric_median")
        name = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")
        shared = serializers.BooleanField(default=False)
        analyze_members = serializers.BooleanField(required=False, allow_null=True, default=None)

    @extend_schema(
        operation_id="api_sae_groups_list",
        responses=SaeGroupListOutputSerializer,
    )
    def get(self, request):
        found = selectors.group_list(user=request.user)
        return Response(
            {
                "groups": [sae_group_state(group, viewer=request.user) for group in found[:200]],
                "total": found.count(),
            }
        )

    @extend_schema(request=TrainSerializer, responses={202: SaeGroupOutputSerializer})
    def post(self, request):
        group = sae_group_train_from_body(user=request.user, body=request.data)
        return Response(sae_group_state(group, viewer=request.user), status=status.HTTP_202_ACCEPTED)


def sae_group_train_from_body(*, user, body: dict[str, Any]) -> SaeGroup:
    """The API's and the page's one path from a request body to a queued group: the body validated
    (a ValidationError names its fields), the caller's model and dataset resolved, the typed
    settings and members built, then the service."""
    data = SaeGroupListApi.TrainSerializer(data=body)
    data.is_valid(raise_exception=True)
    values = dict(data.validated_data)
    model = model_get(user=user, model_id=values.pop("model_id"))
    dataset = dataset_get(user=user, dataset_id=values.pop("dataset_id"))
    name, shared, analyze = values.pop("name"), values.pop("shared"), values.pop("analyze_members")
    settings, members = group_request(values, n_layers=model.num_layers)
    return groups.sae_group_train_request(
        owner=user, model=model, dataset=dataset, settings=settings, members=members, name=name,
        shared=shared, analyze_members=analyze,
    )  # fmt: skip


SAE_GROUP_API = JobApi(
    route="saes/groups/<str:group_id>",
    name="sae-group",
    component="SaeGroup",
    row="group",
    find=selectors.group_get,
    body=lambda group, request: sae_group_state(group, viewer=request.user),
    update=groups.sae_group_update,
    update_fields={
        "name": serializers.CharField(required=False, max_length=500),
        "shared": serializers.BooleanField(required=False),
    },
    delete=groups.sae_group_delete,
    cancel=groups.sae_group_cancel,
    doc="One group with its members' results; its owner may rename or share it (members follow) or\n"
    "delete it once it has ended (its members stay SAEs of their own).",
)
