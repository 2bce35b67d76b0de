from django.apps import AppConfig


class CircuitsConfig(AppConfig):
    name = "circuits"
    verbose_name = "Circuits"

    def ready(self) -> None:
        from circuits import selectors, serializers
        from circuits.models import AttributionGraph
        from mistudio.access import register_visibility
        from mistudio.jobs import register_job_kind

        selectors.register_event_groups()
        register_visibility(
            AttributionGraph,
            lambda user: selectors.graph_list(user=user),
            code="GRAPH_NOT_FOUND",
            what="attribution graph",
        )
        register_job_kind(AttributionGraph, state=serializers.graph_event_state)
