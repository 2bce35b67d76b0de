from django.apps import AppConfig


class FeaturesConfig(AppConfig):
    name = "features"
    verbose_name = "SAE features"

    def ready(self) -> None:
        from features import selectors, serializers
        from features.models import FeatureAnalysis
        from mistudio.access import register_visibility
        from mistudio.jobs import register_job_kind

        selectors.register_event_groups()
        register_visibility(
            FeatureAnalysis,
            lambda user: selectors.analysis_list(user=user),
            code="ANALYSIS_NOT_FOUND",
            what="feature analysis",
        )
        register_job_kind(FeatureAnalysis, state=serializers.analysis_state)
