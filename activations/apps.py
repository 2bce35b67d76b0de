from django.apps import AppConfig


class ActivationsConfig(AppConfig):
    name = "activations"
    verbose_name = "Datasets and activations"

    def ready(self) -> None:
        from django.db.models.signals import pre_delete

        from activations import metrics, selectors, services
        from activations.models import ActivationCache
        from mistudio.metrics import register_database_metrics
        from mistudio.workers import register_worker_hook

        selectors.register_event_groups()
        register_database_metrics(metrics.database_metrics)
        register_worker_hook("start", services.extraction_resume_on_worker_start)
        register_worker_hook("every_sixth_beat", services.cache_cleanup_daily)
        pre_delete.connect(services.cache_files_follow_row, sender=ActivationCache)
