from django.apps import AppConfig


class CircuitsConfig(AppConfig):
    name = "circuits"
    verbose_name = "Circuits"

    def ready(self) -> None:
        from django.db.models.signals import post_delete, post_save

        from circuits import selectors, serializers
        from circuits.apis import GRAPH_API
        from circuits.models import AttributionGraph
        from features.models import Explanation, ExplanationJob, FeatureAnalysis, FeatureLabel
        from mistudio.access import register_visibility
        from mistudio.jobs import register_job_kind
        from saes.models import SparseAutoencoder

        for model in (FeatureLabel, Explanation, ExplanationJob, FeatureAnalysis, SparseAutoencoder):
            for signal in (post_save, post_delete):
                signal.connect(
                    selectors.names_changed, sender=model, dispatch_uid=f"graph-names-{model.__name__}"
                )

        selectors.register_event_groups()
        register_visibility(
            AttributionGraph,
            lambda user: selectors.graph_list(user=user),
            code="GRAPH_NOT_FOUND",
            what="attribution graph",
        )
        register_job_kind(
            AttributionGraph,
            state=serializers.graph_event_state,
            serializer=serializers.GraphOutputSerializer,
            api=GRAPH_API,
        )
