from django.contrib import admin

from evaluations import services
from evaluations.models import BenchResult, BenchRun
from mistudio.access import OPERATOR
from mistudio.admin import JobAdmin


@admin.register(BenchRun)
class BenchRunAdmin(JobAdmin):
    list_display = ["id", "name", "model", "status", "progress", "owner", "shared", "created_at"]
    list_filter = ["status", "shared"]
    search_fields = ["id", "name", "model__name"]
    readonly_fields = [
        field.name for field in BenchRun._meta.fields if field.name not in BenchRun.OWNER_FIELDS
    ]

    def save_model(self, request, obj, form, change) -> None:
        services.bench_update(
            run=obj, actor=OPERATOR, **{field: getattr(obj, field) for field in BenchRun.OWNER_FIELDS}
        )

    def delete_model(self, request, obj) -> None:
        services.bench_delete(run=obj, actor=OPERATOR)

    def delete_queryset(self, request, queryset) -> None:
        for run in queryset:
            services.bench_delete(run=run, actor=OPERATOR)


@admin.register(BenchResult)
class BenchResultAdmin(admin.ModelAdmin):
    """Results are written by their run only: read here, deleted with their run or SAE."""

    list_display = ["id", "run", "sae", "method", "method_version", "seconds", "created_at"]
    list_filter = ["method"]
    search_fields = ["run__id", "sae__id", "sae__name"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
