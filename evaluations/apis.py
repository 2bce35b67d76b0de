"""REST API for SAEBench runs, their results and comparisons (thin views)."""

from __future__ import annotations

import json

from django.http import HttpResponse
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from activations.selectors import dataset_get
from engine.saebench.methods import METHODS
from evaluations import selectors, services
from evaluations.models import BenchRun
from evaluations.serializers import (
    BenchEstimateSerializer,
    BenchListOutputSerializer,
    BenchOutputSerializer,
    ComparisonOutputSerializer,
    ResultListOutputSerializer,
    SaeBenchJsonOutputSerializer,
    bench_state,
    result_state,
)
from mistudio.errors import ApplicationError
from mistudio.job_apis import JobApi
from mistudio.permissions import CanRead, CanWrite
from mistudio.serializers import StrictSerializer
from saes.models import SparseAutoencoder
from saes.selectors import completed_sae, group_get, sae_get, sae_list


class CoreSettingsSerializer(StrictSerializer):
    context_size = serializers.IntegerField(min_value=8, max_value=4096, required=False)
    batch_size_prompts = serializers.IntegerField(min_value=1, max_value=256, required=False)
    n_eval_reconstruction_batches = serializers.IntegerField(min_value=1, max_value=1000, required=False)
    n_eval_sparsity_variance_batches = serializers.IntegerField(min_value=1, max_value=1000, required=False)
    exclude_special_tokens_from_reconstruction = serializers.BooleanField(required=False)


class ProbingSettingsSerializer(StrictSerializer):
    k_values = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=1000),
        min_length=1,
        max_length=10,
        required=False,
    )
    context_length = serializers.IntegerField(min_value=8, max_value=4096, required=False)
    train_fraction = serializers.FloatField(min_value=0.1, max_value=0.9, required=False)
    max_per_class = serializers.IntegerField(min_value=4, max_value=5000, required=False)
    seed = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)


class AbsorptionSettingsSerializer(StrictSerializer):
    max_words = serializers.IntegerField(
        min_value=100, max_value=1_000_000, required=False,
        help_text="At most this many of the vocabulary's words, drawn with the seed (default: all)",
    )  # fmt: skip
    seed = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)
    prompt_template = serializers.RegexField(r"^[^{}]*\{word\}[^{}]*$", max_length=200, required=False)
    max_k = serializers.IntegerField(min_value=1, max_value=50, required=False)
    min_probe_f1 = serializers.FloatField(min_value=0.0, max_value=1.0, required=False)
    min_letters = serializers.IntegerField(min_value=1, max_value=26, required=False)


class BenchListApi(APIView):
    """The SAEBench runs you can see, or judge SAEs (202: a job on their model's worker)."""

    permission_classes = [CanWrite]

    class FilterSerializer(StrictSerializer):
        model_id = serializers.CharField(max_length=64, required=False)

    class InputSerializer(StrictSerializer):
        sae_ids = serializers.ListField(
            child=serializers.CharField(max_length=64), required=False, min_length=1,
            max_length=services.MAX_SAES,
        )  # fmt: skip
        sae_group_id = serializers.CharField(max_length=64, required=False)
        methods = serializers.ListField(
            child=serializers.ChoiceField(choices=list(METHODS)), required=False, min_length=1
        )
        dataset_id = serializers.CharField(max_length=64, required=False)
        probing_dataset_id = serializers.CharField(max_length=64, required=False)
        core = CoreSettingsSerializer(required=False)
        sparse_probing = ProbingSettingsSerializer(required=False)
        absorption = AbsorptionSettingsSerializer(required=False)
        estimate_only = serializers.BooleanField(
            default=False, help_text="Queue nothing: answer 200 with the run's settings, tokens, memory and "
            "absorption's time estimate",
        )  # fmt: skip
        name = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")
        shared = serializers.BooleanField(default=False)

    @extend_schema(
        operation_id="api_saebench_list",
        parameters=[FilterSerializer],
        responses={200: BenchListOutputSerializer},
    )
    def get(self, request):
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        runs = selectors.bench_run_list(user=request.user, model_id=filters.validated_data.get("model_id"))
        return Response(
            {"runs": [bench_state(run, viewer=request.user) for run in runs[:500]], "total": runs.count()}
        )

    @extend_schema(
        request=InputSerializer, responses={202: BenchOutputSerializer, 200: BenchEstimateSerializer}
    )
    def post(self, request):
        run = bench_from_body(request.user, request.data)
        if isinstance(run, dict):
            return Response(run)
        return Response(bench_state(run, viewer=request.user), status=status.HTTP_202_ACCEPTED)


def bench_from_body(user, body) -> BenchRun | dict:
    """The run ``POST /api/saebench``'s body asks for, queued (the comparison page posts the same),
    or what it would be (``estimate_only``)."""
    data = BenchListApi.InputSerializer(data=body)
    data.is_valid(raise_exception=True)
    values = dict(data.validated_data)
    group = group_get(user=user, group_id=values["sae_group_id"]) if "sae_group_id" in values else None
    saes = chosen_saes(user, values.get("sae_ids"), group, completed=True)
    return services.bench_request(
        owner=user,
        saes=saes,
        group=group,
        methods=values.get("methods"),
        dataset=dataset_get(user=user, dataset_id=values["dataset_id"]) if "dataset_id" in values else None,
        probing_dataset=dataset_get(user=user, dataset_id=values["probing_dataset_id"])
        if "probing_dataset_id" in values
        else None,
        core=values.get("core"),
        probing=values.get("sparse_probing"),
        absorption=values.get("absorption"),
        name=values["name"],
        shared=values["shared"],
        estimate_only=values["estimate_only"],
    )


def chosen_saes(user, sae_ids: list[str] | None, group, *, completed: bool) -> list[SparseAutoencoder]:
    """The SAEs a request names (each one the caller may see), or a group's members (in order)."""
    if (sae_ids is None) == (group is None):
        raise ApplicationError(
            "SAES_REQUIRED",
            "Give sae_ids or sae_group_id.",
            details={"fields": {"sae_ids": ["Or sae_group_id."]}},
        )
    if group is not None:
        members = list(group.members.order_by("group_index"))
        return (
            [sae for sae in members if sae.status == SparseAutoencoder.Status.COMPLETED]
            if completed
            else members
        )
    find = completed_sae if completed else sae_get
    return [find(user=user, sae_id=sae_id) for sae_id in dict.fromkeys(sae_ids)]


BENCH_API = JobApi(
    route="saebench/<str:run_id>",
    name="bench",
    component="Bench",
    row="run",
    find=selectors.bench_run_get,
    body=lambda run, request: bench_state(run, viewer=request.user),
    update=services.bench_update,
    update_fields={
        "name": serializers.CharField(max_length=500, required=False, allow_blank=True),
        "shared": serializers.BooleanField(required=False),
    },
    delete=services.bench_delete,
    find_to_change=selectors.bench_run_get_to_change,
    cancel=services.bench_cancel,
    cancel_doc="Cancel a run (its owner or an admin); the results it finished stay.",
)


class BenchResultsApi(APIView):
    """A run's results: each (SAE, method) it finished, for the SAEs you can see."""

    permission_classes = [CanRead]

    @extend_schema(responses={200: ResultListOutputSerializer})
    def get(self, request, run_id: str):
        run = selectors.bench_run_get(user=request.user, run_id=run_id)
        results = selectors.result_list(user=request.user).filter(run=run).order_by("id")
        return Response({"results": [result_state(result) for result in results]})


class BenchExportApi(APIView):
    """One SAE's result of one method in SAEBench's results JSON (what its result viewer and
    Neuronpedia read): ``<sae>_<method>_eval_results.json``."""

    permission_classes = [CanRead]

    class QuerySerializer(StrictSerializer):
        sae_id = serializers.CharField(max_length=64)
        method = serializers.ChoiceField(choices=list(METHODS), default="core")

    @extend_schema(parameters=[QuerySerializer], responses={200: SaeBenchJsonOutputSerializer})
    def get(self, request, run_id: str):
        run = selectors.bench_run_get(user=request.user, run_id=run_id)  # a 404 before any 400
        query = self.QuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        values = query.validated_data
        result = selectors.result_get(
            user=request.user, run_id=run.id, sae_id=values["sae_id"], method=values["method"]
        )
        response = HttpResponse(json.dumps(selectors.result_export(result)), content_type="application/json")
        filename = f"{result.sae_id}_{result.method}_eval_results.json"
        response["Content-Disposition"] = f'attachment; filename="{filename}"'
        return response


class BenchCompareApi(APIView):
    """Many SAEs side by side: every method's newest numbers for each (chosen SAEs, a group's
    members or a run's SAEs), sortable by any column."""

    permission_classes = [CanRead]

    class QuerySerializer(StrictSerializer):
        sae_ids = serializers.CharField(max_length=64 * 70, required=False, help_text="Comma-separated ids")
        sae_group_id = serializers.CharField(max_length=64, required=False)
        run_id = serializers.CharField(max_length=64, required=False)
        sort = serializers.CharField(max_length=100, required=False, help_text="A column key, or name")
        descending = serializers.BooleanField(default=True)

    @extend_schema(parameters=[QuerySerializer], responses={200: ComparisonOutputSerializer})
    def get(self, request):
        query = self.QuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        values = query.validated_data
        table = compared(request.user, values)
        if values.get("sort"):
            table["rows"] = selectors.sorted_rows(
                table["rows"], values["sort"], descending=values["descending"]
            )
        return Response(table)


def compared(user, values: dict) -> dict:
    """The comparison of the SAEs a query names: ``sae_ids`` (comma-separated), ``sae_group_id``
    or ``run_id``."""
    if values.get("run_id"):
        run = selectors.bench_run_get(user=user, run_id=values["run_id"])
        visible = {sae.id: sae for sae in sae_list(user=user).filter(pk__in=run.saes)}
        saes = [visible[sae_id] for sae_id in run.saes if sae_id in visible]
    else:
        group = group_get(user=user, group_id=values["sae_group_id"]) if values.get("sae_group_id") else None
        ids = [item.strip() for item in (values.get("sae_ids") or "").split(",") if item.strip()] or None
        if ids is not None and len(ids) > services.MAX_SAES:
            raise ApplicationError("INVALID_SAES", f"Compare at most {services.MAX_SAES} SAEs.")
        saes = chosen_saes(user, ids, group, completed=False)
    return selectors.comparison(user=user, saes=saes)
