from django.contrib import admin, messages

from mistudio.access import OPERATOR
from mistudio.admin import JobAdmin
from mistudio.errors import ApplicationError
from saes import groups, services
from saes.models import SaeEvaluation, SaeGroup, SparseAutoencoder


@admin.register(SparseAutoencoder)
class SparseAutoencoderAdmin(JobAdmin):
    list_display = [
        "id",
        "name",
        "model",
        "hook_name",
        "architecture",
        "d_sae",
        "status",
        "progress",
        "created_at",
    ]
    list_filter = ["status", "architecture", "source", "shared"]
    search_fields = ["id", "name", "hook_name", "model__name", "model_name"]
    readonly_fields = [
        field.name
        for field in SparseAutoencoder._meta.fields
        if field.name not in SparseAutoencoder.OWNER_FIELDS
    ]
    actions = [*JobAdmin.actions, "evaluate"]

    def save_model(self, request, obj, form, change) -> None:
        services.sae_update(
            sae=obj, actor=OPERATOR, **{name: form.cleaned_data[name] for name in form.changed_data}
        )

    def delete_model(self, request, obj) -> None:
        services.sae_delete(sae=obj, actor=OPERATOR)

    def delete_queryset(self, request, queryset) -> None:
        for sae in queryset:
            services.sae_delete(sae=sae, actor=OPERATOR)

    @admin.action(description="Evaluate selected SAEs (held-out metrics, CE loss recovered)")
    def evaluate(self, request, queryset):
        for sae in queryset:
            try:
                services.sae_evaluate_request(sae=sae, actor=OPERATOR)
                self.message_user(request, f"{sae.id}: evaluation queued.")
            except ApplicationError as error:
                self.message_user(request, f"{sae.id}: {error.message}", level=messages.WARNING)


@admin.register(SaeEvaluation)
class SaeEvaluationAdmin(JobAdmin):
    list_display = ["id", "sae", "cache", "status", "progress", "owner", "created_at"]
    list_filter = ["status"]
    search_fields = ["id", "sae__id", "sae__name", "cache__id"]
    readonly_fields = [field.name for field in SaeEvaluation._meta.fields]


@admin.register(SaeGroup)
class SaeGroupAdmin(JobAdmin):
    list_display = ["id", "name", "model", "dataset", "status", "progress", "owner", "created_at"]
    list_filter = ["status", "shared"]
    search_fields = ["id", "name", "model__name"]
    readonly_fields = [
        field.name for field in SaeGroup._meta.fields if field.name not in SaeGroup.OWNER_FIELDS
    ]

    def save_model(self, request, obj, form, change) -> None:
        groups.sae_group_update(
            group=obj, actor=OPERATOR, **{name: form.cleaned_data[name] for name in form.changed_data}
        )
