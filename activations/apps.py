from django.apps import AppConfig


class ActivationsConfig(AppConfig):
    name = "activations"
    verbose_name = "Datasets and activations"

    def ready(self) -> None:
        from django.db.models.signals import pre_delete

        from activations import metrics, selectors, services
        from activations.apis import EXTRACTION_API
        from activations.models import ActivationCache, Dataset, ExtractionJob
        from mistudio.access import register_visibility
        from mistudio.jobs import register_job_kind
        from mistudio.metrics import register_database_metrics
        from mistudio.workers import register_worker_hook

        selectors.register_event_groups()
        register_database_metrics(metrics.database_metrics)
        register_job_kind(ExtractionJob, state=services.job_state, api=EXTRACTION_API)
        register_visibility(
            ActivationCache,
            lambda user: selectors.cache_list(user=user),
            code="CACHE_NOT_FOUND",
            what="activation cache",
        )
        register_visibility(
            Dataset, lambda user: selectors.dataset_list(user=user), code="DATASET_NOT_FOUND", what="dataset"
        )
        register_visibility(
            ExtractionJob,
            lambda user: selectors.extraction_list(user=user),
            code="EXTRACTION_NOT_FOUND",
            what="extraction",
        )
        register_worker_hook("every_sixth_beat", services.cache_cleanup_daily)
        pre_delete.connect(services.cache_files_follow_row, sender=ActivationCache)
