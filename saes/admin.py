from django.contrib import admin, messages

from mistudio.access import OPERATOR
from mistudio.errors import ApplicationError
from saes import services
from saes.models import SparseAutoencoder


@admin.register(SparseAutoencoder)
class SparseAutoencoderAdmin(admin.ModelAdmin):
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
    actions = ["cancel_trainings", "evaluate"]

    def has_add_permission(self, request) -> bool:
        return False  # training and import go through the API, the pages or `manage.py train_sae`

    def save_model(self, request, obj, form, change) -> None:
        services.sae_update(
            sae=obj, actor=OPERATOR, **{name: form.cleaned_data[name] for name in form.changed_data}
        )

    def delete_model(self, request, obj) -> None:
        services.sae_delete(sae=obj, actor=OPERATOR)

    def delete_queryset(self, request, queryset) -> None:
        for sae in queryset:
            services.sae_delete(sae=sae, actor=OPERATOR)

    def each(self, request, queryset, action, done: str) -> None:
        for sae in queryset:
            try:
                action(sae=sae, actor=OPERATOR)
                self.message_user(request, f"{sae.id}: {done}.")
            except ApplicationError as error:
                self.message_user(request, f"{sae.id}: {error.message}", level=messages.WARNING)

    @admin.action(description="Cancel selected trainings")
    def cancel_trainings(self, request, queryset):
        self.each(request, queryset, services.sae_cancel, "cancelled")

    @admin.action(description="Evaluate selected SAEs (held-out metrics, CE loss recovered)")
    def evaluate(self, request, queryset):
        self.each(request, queryset, services.sae_evaluate_request, "evaluation queued")
