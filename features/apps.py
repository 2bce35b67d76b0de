from django.apps import AppConfig


class FeaturesConfig(AppConfig):
    name = "features"
    verbose_name = "SAE features"

    def ready(self) -> None:
        from django.db.models.signals import pre_delete

        from features import selectors, services
        from features.models import FeatureAnalysis
        from mistudio.workers import register_worker_hook

        selectors.register_event_groups()
        register_worker_hook("start", services.analysis_resume_on_worker_start)
        pre_delete.connect(services.analysis_files_follow_row, sender=FeatureAnalysis)
