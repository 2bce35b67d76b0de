from django.apps import AppConfig


class FeaturesConfig(AppConfig):
    name = "features"
    verbose_name = "SAE features"

    def ready(self) -> None:
        from features import explanation_selectors, selectors, serializers, services
        from features.apis import ANALYSIS_API
        from features.explanation_apis import EXPLANATION_JOB_API
        from features.models import ExplanationJob, FeatureAnalysis
        from generation.interventions import register_feature_scale
        from mistudio.access import register_visibility
        from mistudio.jobs import register_job_kind
        from saes.selectors import register_export_extra, register_import_extra
        from saes.signals import group_completed

        selectors.register_event_groups()
        register_visibility(
            FeatureAnalysis,
            lambda user: selectors.analysis_list(user=user),
            code="ANALYSIS_NOT_FOUND",
            what="feature analysis",
        )
        register_job_kind(
            FeatureAnalysis,
            state=serializers.analysis_state,
            serializer=serializers.AnalysisOutputSerializer,
            api=ANALYSIS_API,
        )
        explanation_selectors.register_event_groups()
        register_visibility(
            ExplanationJob,
            lambda user: explanation_selectors.explanation_job_list(user=user),
            code="EXPLANATION_JOB_NOT_FOUND",
            what="explanation job",
        )
        register_job_kind(
            ExplanationJob,
            state=serializers.explanation_job_state,
            serializer=serializers.ExplanationJobOutputSerializer,
            api=EXPLANATION_JOB_API,
        )
        register_feature_scale(selectors.feature_max_activation)
        register_export_extra(services.labels_export)
        register_import_extra(services.labels_import)
        group_completed.connect(services.group_members_analyze, dispatch_uid="features-analyze-group")
