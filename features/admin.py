from django.contrib import admin

from features import explanations, services
from features.models import Explanation, ExplanationJob, FeatureAnalysis, FeatureLabel
from mistudio.access import OPERATOR
from mistudio.admin import JobAdmin


@admin.register(FeatureAnalysis)
class FeatureAnalysisAdmin(JobAdmin):
    list_display = ["id", "sae", "cache", "status", "phase", "progress", "tokens", "created_at"]
    list_filter = ["status", "shared"]
    search_fields = ["id", "sae__id", "sae__name", "cache__id"]
    readonly_fields = [field.name for field in FeatureAnalysis._meta.fields if field.name != "shared"]

    def save_model(self, request, obj, form, change) -> None:
        services.analysis_update(analysis=obj, actor=OPERATOR, shared=form.cleaned_data["shared"])

    def delete_model(self, request, obj) -> None:
        services.analysis_delete(analysis=obj, actor=OPERATOR)

    def delete_queryset(self, request, queryset) -> None:
        for analysis in queryset:
            services.analysis_delete(analysis=analysis, actor=OPERATOR)


@admin.register(FeatureLabel)
class FeatureLabelAdmin(admin.ModelAdmin):
    list_display = ["sae", "index", "label", "owner", "shared", "updated_at"]
    list_filter = ["shared"]
    search_fields = ["label", "notes", "sae__id", "sae__name"]
    readonly_fields = ["sae", "index", "owner", "created_at", "updated_at"]

    def has_add_permission(self, request) -> bool:
        return False  # labels are set on the feature's page, through the API or the admin's edits


class ExplanationInline(admin.TabularInline):
    model = Explanation
    fields = ["index", "text", "score", "detection", "fuzzing", "error_code"]
    readonly_fields = fields
    extra = 0
    max_num = 0  # written by the job only
    show_change_link = False


@admin.register(ExplanationJob)
class ExplanationJobAdmin(JobAdmin):
    list_display = [
        "id",
        "analysis",
        "endpoint",
        "explainer_model",
        "status",
        "progress",
        "features_done",
        "created_at",
    ]
    list_filter = ["status", "endpoint", "shared"]
    search_fields = ["id", "analysis__id", "analysis__sae__id", "explainer_model"]
    readonly_fields = [field.name for field in ExplanationJob._meta.fields if field.name != "shared"]
    inlines = [ExplanationInline]

    def save_model(self, request, obj, form, change) -> None:
        explanations.explanation_job_update(job=obj, actor=OPERATOR, shared=form.cleaned_data["shared"])
