from django.contrib import admin

from mistudio.access import OPERATOR
from mistudio.admin import JobAdmin
from steering import services
from steering.models import SteeringVector


@admin.register(SteeringVector)
class SteeringVectorAdmin(JobAdmin):
    list_display = [
        "id", "name", "model", "hook_name", "width", "norm", "status", "owner", "shared", "created_at",
    ]  # fmt: skip
    list_filter = ["status", "source", "shared"]
    search_fields = ["id", "name", "hook_name", "model__name"]
    readonly_fields = [
        field.name for field in SteeringVector._meta.fields if field.name not in SteeringVector.OWNER_FIELDS
    ]

    def save_model(self, request, obj, form, change) -> None:
        services.vector_update(vector=obj, actor=OPERATOR, name=obj.name, shared=obj.shared)

    def delete_model(self, request, obj) -> None:
        services.vector_delete(vector=obj, actor=OPERATOR)

    def delete_queryset(self, request, queryset) -> None:
        for vector in queryset:
            services.vector_delete(vector=vector, actor=OPERATOR)
