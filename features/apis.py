"""REST API for feature analyses, feature dashboards, labels and live encoding (thin views)."""

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from activations.selectors import completed_cache, dataset_get
from features import exports, selectors, services
from features.search import feature_search
from features.serializers import (
    AnalysisListOutputSerializer,
    AnalysisOutputSerializer,
    EncodeOutputSerializer,
    FeatureDetailOutputSerializer,
    FeatureExportOutputSerializer,
    FeaturePageOutputSerializer,
    LabelChangeOutputSerializer,
    SearchOutputSerializer,
    analysis_state,
    label_state,
)
from mistudio.job_apis import JobApi
from mistudio.permissions import CanRead, CanWrite
from mistudio.serializers import StrictSerializer
from mistudio.streaming import ChunkedStreamingResponse
from mistudio.throttling import WorkerCallThrottle
from saes.selectors import completed_sae, sae_get


class AnalysisListApi(APIView):
    """An SAE's feature analyses, or start one (202) over an activation cache (``cache_id``) or over
    a dataset read straight through the SAE's model (``dataset_id``, optionally ``sample_count``
    and ``max_length``: no cache written). Neither: the SAE's training cache, else its training
    dataset through the model."""

    permission_classes = [CanWrite]

    class InputSerializer(StrictSerializer):
        cache_id = serializers.CharField(max_length=64, required=False)
        dataset_id = serializers.CharField(max_length=64, required=False)
        sample_count = serializers.IntegerField(min_value=1, max_value=10_000_000, required=False)
        max_length = serializers.IntegerField(min_value=1, max_value=1_000_000, required=False)
        shared = serializers.BooleanField(required=False)

    @extend_schema(operation_id="api_saes_analyses_list", responses={200: AnalysisListOutputSerializer})
    def get(self, request, sae_id: str):
        sae = sae_get(user=request.user, sae_id=sae_id)
        analyses = selectors.analysis_list(user=request.user, sae=sae)
        return Response(
            {
                "analyses": [analysis_state(row, viewer=request.user) for row in analyses[:200]],
                "total": analyses.count(),
            }
        )

    @extend_schema(request=InputSerializer, responses={202: AnalysisOutputSerializer})
    def post(self, request, sae_id: str):
        sae = completed_sae(user=request.user, sae_id=sae_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values, user = data.validated_data, request.user
        cache = completed_cache(user=user, cache_id=values["cache_id"]) if "cache_id" in values else None
        dataset = dataset_get(user=user, dataset_id=values["dataset_id"]) if "dataset_id" in values else None
        analysis = services.analysis_request(
            owner=user, sae=sae, cache=cache, dataset=dataset, sample_count=values.get("sample_count"),
            max_length=values.get("max_length"), shared=values.get("shared", False),
        )  # fmt: skip
        return Response(analysis_state(analysis, viewer=request.user), status=status.HTTP_202_ACCEPTED)


def analysis_find(*, user, sae_id: str, analysis_id: str):
    """An analysis the caller may see, reached through an SAE they may see."""
    return selectors.analysis_get(user=user, sae=sae_get(user=user, sae_id=sae_id), analysis_id=analysis_id)


ANALYSIS_API = JobApi(
    route="saes/<str:sae_id>/analyses/<str:analysis_id>",
    name="analysis",
    component="Analysis",
    row="analysis",
    find=analysis_find,
    body=lambda analysis, request: analysis_state(analysis, viewer=request.user),
    update=services.analysis_update,
    update_fields={"shared": serializers.BooleanField()},
    delete=services.analysis_delete,
    cancel=services.analysis_cancel,
)


class FeatureListApi(APIView):
    """The features of an SAE's newest completed analysis (or ``analysis``), paged, filtered, sorted."""

    permission_classes = [CanRead]

    class FilterSerializer(StrictSerializer):
        analysis = serializers.CharField(max_length=64, required=False)
        density_min = serializers.FloatField(min_value=0, max_value=1, required=False)
        density_max = serializers.FloatField(min_value=0, max_value=1, required=False)
        dead = serializers.BooleanField(required=False, allow_null=True, default=None)
        labelled = serializers.BooleanField(required=False, allow_null=True, default=None)
        explained = serializers.BooleanField(required=False, allow_null=True, default=None)
        score_min = serializers.FloatField(min_value=0, max_value=1, required=False)
        q = serializers.CharField(max_length=200, required=False, allow_blank=True)
        token = serializers.CharField(max_length=100, required=False, allow_blank=True, trim_whitespace=False)
        sort = serializers.ChoiceField(choices=list(selectors.SORTS), default="index")
        page = serializers.IntegerField(min_value=1, max_value=2**24, default=1)  # past the last: empty
        page_size = serializers.IntegerField(min_value=1, max_value=500, default=50)

    @extend_schema(
        operation_id="api_saes_features_list",
        parameters=[FilterSerializer],
        responses={200: FeaturePageOutputSerializer},
    )
    def get(self, request, sae_id: str):
        sae = sae_get(user=request.user, sae_id=sae_id)
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        values = dict(filters.validated_data)
        analysis = selectors.current_analysis(
            user=request.user, sae=sae, analysis_id=values.pop("analysis", None)
        )
        page, page_size = values.pop("page"), values.pop("page_size")
        return Response(
            selectors.feature_page(
                user=request.user, sae=sae, analysis=analysis, filters=values, page=page, page_size=page_size
            )
        )


class FeatureDetailApi(APIView):
    """One feature's dashboard data; PATCH sets the caller's own label and notes on it."""

    permission_classes = [CanWrite]

    class QuerySerializer(StrictSerializer):
        analysis = serializers.CharField(max_length=64, required=False)

    class LabelSerializer(StrictSerializer):
        label = serializers.CharField(max_length=200, required=False, allow_blank=True)
        notes = serializers.CharField(max_length=10_000, required=False, allow_blank=True)
        shared = serializers.BooleanField(required=False)

    @extend_schema(parameters=[QuerySerializer], responses={200: FeatureDetailOutputSerializer})
    def get(self, request, sae_id: str, index: int):
        sae = sae_get(user=request.user, sae_id=sae_id)
        query = self.QuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        analysis = selectors.current_analysis(
            user=request.user, sae=sae, analysis_id=query.validated_data.get("analysis")
        )
        return Response(selectors.feature_detail(user=request.user, sae=sae, analysis=analysis, index=index))

    @extend_schema(request=LabelSerializer, responses={200: LabelChangeOutputSerializer})
    def patch(self, request, sae_id: str, index: int):
        sae = sae_get(user=request.user, sae_id=sae_id)
        data = self.LabelSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        label = services.feature_label_set(sae=sae, index=index, actor=request.user, **data.validated_data)
        return Response({"index": index, "label": label_state(label) if label.pk else None})


class FeatureEncodeApi(APIView):
    """Which features fire on a text (the SAE's model must be loaded)."""

    permission_classes = [CanWrite]
    throttle_classes = [WorkerCallThrottle]

    class InputSerializer(StrictSerializer):
        text = serializers.CharField(max_length=services.MAX_ENCODE_CHARS, trim_whitespace=False)
        top = serializers.IntegerField(min_value=1, max_value=100, default=10)

    @extend_schema(request=InputSerializer, responses={200: EncodeOutputSerializer})
    def post(self, request, sae_id: str):
        sae = sae_get(user=request.user, sae_id=sae_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        result = services.feature_encode(sae=sae, actor=request.user, **data.validated_data)
        return Response(selectors.with_feature_names(user=request.user, sae=sae, result=result))


class FeatureExportApi(APIView):
    """Every feature's dashboard as one JSON document (Neuronpedia-like fields; docs/api.md)."""

    permission_classes = [CanRead]

    @extend_schema(
        parameters=[FeatureDetailApi.QuerySerializer],
        responses={(200, "application/json"): FeatureExportOutputSerializer},
    )
    def get(self, request, sae_id: str):
        sae = sae_get(user=request.user, sae_id=sae_id)
        query = FeatureDetailApi.QuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        analysis = selectors.current_analysis(
            user=request.user, sae=sae, analysis_id=query.validated_data.get("analysis")
        )
        response = ChunkedStreamingResponse(
            exports.analysis_export_stream(user=request.user, sae=sae, analysis=analysis),
            content_type="application/json",
        )
        response["Content-Disposition"] = f'attachment; filename="{sae.id}-features.json"'
        return response


class FeatureSearchApi(APIView):
    """Features by meaning: the analysis's explanations and labels nearest ``q`` (cosine of their
    sentence embeddings), best first, with each explanation's score."""

    permission_classes = [CanRead]

    class QuerySerializer(StrictSerializer):
        q = serializers.CharField(max_length=500)
        analysis = serializers.CharField(max_length=64, required=False)
        k = serializers.IntegerField(min_value=1, max_value=200, default=20)

    @extend_schema(
        operation_id="api_saes_features_search",
        parameters=[QuerySerializer],
        responses={200: SearchOutputSerializer},
    )
    def get(self, request, sae_id: str):
        sae = sae_get(user=request.user, sae_id=sae_id)
        query = self.QuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        values = query.validated_data
        analysis = selectors.current_analysis(user=request.user, sae=sae, analysis_id=values.get("analysis"))
        return Response(
            feature_search(user=request.user, sae=sae, analysis=analysis, query=values["q"], k=values["k"])
        )
