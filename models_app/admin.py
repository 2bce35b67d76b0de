from functools import partial

from django.contrib import admin, messages

from mistudio.access import OPERATOR
from mistudio.errors import ApplicationError
from models_app import services
from models_app.models import LanguageModel


@admin.register(LanguageModel)
class LanguageModelAdmin(admin.ModelAdmin):
    """Models in the admin: the same services as the API for load, unload and delete."""

    list_display = [
        "id", "name", "model_type", "quantization", "status", "progress", "pinned", "host_worker",
        "created_at",
    ]  # fmt: skip
    list_filter = ["status", "model_type", "source", "quantization", "pinned"]
    search_fields = ["id", "name", "identifier"]
    fields = [
        "id", "name", "source", "identifier", "revision", "commit_sha", "model_type", "architecture",
        "quantization", "pinned", "keep_alive_seconds", "status", "progress", "stage", "status_message",
        "memory_usage_bytes", "memory_by_device", "memory_estimates", "load_time_seconds", "parameter_count",
        "hidden_size", "num_layers", "vocab_size", "context_length", "host_worker", "unload_reason",
        "rq_job_id", "error_code", "error_message", "owner", "created_at", "loaded_at", "last_used_at",
        "updated_at", "config",
    ]  # fmt: skip
    readonly_fields = [field for field in fields if field not in {"name", "pinned", "keep_alive_seconds"}]
    actions = ["load_models", "unload_models", "delete_models"]

    def has_add_permission(self, request) -> bool:
        return False  # registration inspects the model: use the API, the page or `manage.py add_model`

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # ours unloads first
        return actions

    def save_model(self, request, obj, form, change) -> None:
        services.model_update(
            model_id=obj.pk,
            actor=OPERATOR,
            **{field: form.cleaned_data[field] for field in form.changed_data},
        )

    def delete_model(self, request, obj) -> None:
        services.model_delete(model_id=obj.pk)

    def _run(self, request, queryset, operation, verb: str) -> None:
        for model in queryset:
            try:
                operation(model_id=model.id)
                self.message_user(request, f"{model.name}: {verb}.")
            except ApplicationError as error:
                self.message_user(request, f"{model.name}: {error.message}", level=messages.WARNING)

    @admin.action(description="Load selected models")
    def load_models(self, request, queryset):
        self._run(request, queryset, partial(services.model_load_request, actor=OPERATOR), "load queued")

    @admin.action(description="Unload selected models")
    def unload_models(self, request, queryset):
        self._run(request, queryset, services.model_unload_request, "unload queued")

    @admin.action(description="Delete selected models (unloading them first)")
    def delete_models(self, request, queryset):
        self._run(request, queryset, services.model_delete, "deleted")
