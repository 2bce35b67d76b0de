from django.contrib import admin, messages

from mistudio.errors import ApplicationError
from models_app import services
from models_app.models import LanguageModel


@admin.register(LanguageModel)
class LanguageModelAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "name",
        "model_type",
        "quantization",
        "status",
        "progress",
        "host_worker",
        "created_at",
    ]
    list_filter = ["status", "model_type", "source", "quantization"]
    search_fields = ["id", "name", "identifier"]
    readonly_fields = [
        "id", "status", "progress", "status_message", "memory_usage_bytes", "load_time_seconds",
        "parameter_count", "hidden_size", "num_layers", "vocab_size", "host_worker", "rq_job_id",
        "error_code", "error_message", "created_at", "loaded_at", "last_used_at", "updated_at",
    ]  # fmt: skip
    actions = ["load_models", "unload_models"]

    def _run(self, request, queryset, operation, verb: str) -> None:
        for model in queryset:
            try:
                operation(model_id=model.id)
                self.message_user(request, f"{model.name}: {verb} queued.")
            except ApplicationError as error:
                self.message_user(request, f"{model.name}: {error.message}", level=messages.WARNING)

    @admin.action(description="Load selected models")
    def load_models(self, request, queryset):
        self._run(request, queryset, services.model_load_request, "load")

    @admin.action(description="Unload selected models")
    def unload_models(self, request, queryset):
        self._run(request, queryset, services.model_unload_request, "unload")
