"""REST API for automatic interpretation: explainer endpoints, explanation jobs, their results, and
accepting an explanation as a feature's label (thin views over ``features.explanations``)."""

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from engine.autointerp.pipeline import OPTION_BOUNDS
from engine.autointerp.prompts import PROMPT_VERSION
from engine.autointerp.scoring import prompt_templates, scorer_names
from features import explanation_selectors, explanations, selectors
from features.serializers import (
    ExplainersOutputSerializer,
    ExplanationDryRunOutputSerializer,
    ExplanationJobListOutputSerializer,
    ExplanationJobOutputSerializer,
    ExplanationPageOutputSerializer,
    LabelChangeOutputSerializer,
    explanation_job_state,
    explanation_state,
    label_state,
)
from mistudio.job_apis import JobApi
from mistudio.permissions import CanRead, CanWrite
from mistudio.serializers import StrictSerializer
from saes.selectors import sae_get

MAX_PAGE_SIZE = 500


class ExplainerListApi(APIView):
    """The explainer endpoints a job may use (never their keys) and the prompts' version and text."""

    permission_classes = [CanRead]

    @extend_schema(responses={200: ExplainersOutputSerializer})
    def get(self, request):
        return Response(
            {
                "endpoints": explanations.explainer_endpoints(),
                "prompt_version": PROMPT_VERSION,
                "templates": prompt_templates(),
            }
        )


class SelectionSerializer(StrictSerializer):
    kind = serializers.ChoiceField(choices=["all", "top", "density", "list"], default="top")
    count = serializers.IntegerField(min_value=1, max_value=explanations.MAX_INDICES, required=False)
    min = serializers.FloatField(min_value=0, max_value=1, required=False)
    max = serializers.FloatField(min_value=0, max_value=1, required=False)
    indices = serializers.ListField(
        child=serializers.IntegerField(min_value=0), max_length=explanations.MAX_INDICES, required=False
    )


def bounded(name: str, field=serializers.IntegerField):
    """An option's field with its range from ``OPTION_BOUNDS`` (the service checks the same
    ranges for every front door; ``concurrency``'s maximum is a setting, checked there)."""
    low, high = OPTION_BOUNDS[name]
    return field(min_value=low, max_value=high, required=False)


class OptionsSerializer(StrictSerializer):
    explain_examples = bounded("explain_examples")
    test_examples = bounded("test_examples")
    non_activating = bounded("non_activating")
    per_prompt = bounded("per_prompt")
    scorers = serializers.ListField(
        child=serializers.ChoiceField(choices=scorer_names()), max_length=len(scorer_names()), required=False
    )
    explain_max_tokens = bounded("explain_max_tokens")
    score_max_tokens = bounded("score_max_tokens")
    temperature = bounded("temperature", serializers.FloatField)
    include_logits = serializers.BooleanField(required=False)
    ignore_eos = serializers.BooleanField(required=False)
    concurrency = bounded("concurrency")  # at most EXPLAINER_MAX_CONCURRENCY: 400 beyond


class ExplanationJobListApi(APIView):
    """An SAE's explanation jobs, or start one over a completed analysis (202; ``dry_run``: 200 with
    the estimate only)."""

    permission_classes = [CanWrite]

    class InputSerializer(StrictSerializer):
        analysis_id = serializers.CharField(max_length=64, required=False)
        endpoint = serializers.CharField(max_length=64, default=explanations.LOCAL)
        explainer_model = serializers.CharField(max_length=200)
        scorer_model = serializers.CharField(max_length=200, required=False, allow_blank=True)
        selection = SelectionSerializer(required=False)
        options = OptionsSerializer(required=False)
        shared = serializers.BooleanField(default=False)
        dry_run = serializers.BooleanField(default=False)

    @extend_schema(
        operation_id="api_saes_explanations_list", responses={200: ExplanationJobListOutputSerializer}
    )
    def get(self, request, sae_id: str):
        sae = sae_get(user=request.user, sae_id=sae_id)
        rows = explanation_selectors.explanation_job_list(user=request.user).filter(analysis__sae=sae)
        return Response(
            {
                "jobs": [explanation_job_state(row, viewer=request.user) for row in rows[:200]],
                "total": rows.count(),
            }
        )

    @extend_schema(
        request=InputSerializer,
        responses={202: ExplanationJobOutputSerializer, 200: ExplanationDryRunOutputSerializer},
    )
    def post(self, request, sae_id: str):
        sae = sae_get(user=request.user, sae_id=sae_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        analysis = selectors.current_analysis(
            user=request.user, sae=sae, analysis_id=values.pop("analysis_id", None)
        )
        result = explanations.explanation_request(
            owner=request.user,
            analysis=analysis,
            endpoint=values["endpoint"],
            explainer_model=values["explainer_model"],
            scorer_model=values.get("scorer_model") or None,
            selection=dict(values.get("selection") or {"kind": "top", "count": 50}),
            options=dict(values.get("options") or {}),
            shared=values["shared"],
            dry_run=values["dry_run"],
        )
        if values["dry_run"]:
            return Response(result)
        return Response(explanation_job_state(result, viewer=request.user), status=status.HTTP_202_ACCEPTED)


def explanation_job_find(*, user, sae_id: str, job_id: str):
    """An explanation job the caller may see, reached through an SAE they may see."""
    return explanation_selectors.explanation_job_get(
        user=user, sae=sae_get(user=user, sae_id=sae_id), job_id=job_id
    )


EXPLANATION_JOB_API = JobApi(
    route="saes/<str:sae_id>/explanations/<str:job_id>",
    name="explanation",
    component="ExplanationJob",
    row="job",
    find=explanation_job_find,
    body=lambda job, request: explanation_job_state(job, viewer=request.user),
    update=explanations.explanation_job_update,
    update_fields={"shared": serializers.BooleanField()},
    cancel=explanations.explanation_cancel,
    cancel_status=status.HTTP_200_OK,
)


class ExplanationResultsApi(APIView):
    """A job's explanations, by feature index, paged (``prompt=true``: with the explainer's messages)."""

    permission_classes = [CanRead]

    class QuerySerializer(StrictSerializer):
        page = serializers.IntegerField(min_value=1, max_value=2**24, default=1)
        page_size = serializers.IntegerField(min_value=1, max_value=MAX_PAGE_SIZE, default=100)
        prompt = serializers.BooleanField(default=False)

    @extend_schema(parameters=[QuerySerializer], responses={200: ExplanationPageOutputSerializer})
    def get(self, request, sae_id: str, job_id: str):
        job = explanation_job_find(user=request.user, sae_id=sae_id, job_id=job_id)
        query = self.QuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        page, size = query.validated_data["page"], query.validated_data["page_size"]
        rows = job.explanations.order_by("index")
        return Response(
            {
                "job_id": job.id,
                "total": rows.count(),
                "page": page,
                "page_size": size,
                "explanations": [
                    explanation_state(row, prompt=query.validated_data["prompt"])
                    for row in rows[(page - 1) * size : page * size]
                ],
            }
        )


class ExplanationAcceptApi(APIView):
    """Make an explanation (or an edited ``text`` of it) the caller's label of its feature."""

    permission_classes = [CanWrite]

    class InputSerializer(StrictSerializer):
        text = serializers.CharField(max_length=200, required=False, allow_blank=True)

    @extend_schema(request=InputSerializer, responses={200: LabelChangeOutputSerializer})
    def post(self, request, sae_id: str, index: int, explanation_id: int):
        sae = sae_get(user=request.user, sae_id=sae_id)
        explanation = explanation_selectors.explanation_get(
            user=request.user, sae=sae, index=index, explanation_id=explanation_id
        )
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        label = explanations.explanation_accept(
            explanation=explanation, actor=request.user, text=data.validated_data.get("text")
        )
        return Response({"index": index, "label": label_state(label) if label.pk else None})
