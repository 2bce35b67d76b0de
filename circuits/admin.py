from django.contrib import admin

from circuits import services
from circuits.models import AttributionGraph
from mistudio.access import OPERATOR
from mistudio.admin import JobAdmin


@admin.register(AttributionGraph)
class AttributionGraphAdmin(JobAdmin):
    list_display = ["id", "name", "model", "status", "progress", "owner", "shared", "created_at"]
    list_filter = ["status", "shared"]
    search_fields = ["id", "name", "prompt", "model__name"]
    readonly_fields = [
        field.name
        for field in AttributionGraph._meta.fields
        if field.name not in AttributionGraph.OWNER_FIELDS
    ]

    def save_model(self, request, obj, form, change) -> None:
        services.graph_update(
            graph=obj,
            actor=OPERATOR,
            **{field: getattr(obj, field) for field in AttributionGraph.OWNER_FIELDS},
        )

    def delete_model(self, request, obj) -> None:
        services.graph_delete(graph=obj, actor=OPERATOR)

    def delete_queryset(self, request, queryset) -> None:
        for graph in queryset:
            services.graph_delete(graph=graph, actor=OPERATOR)
