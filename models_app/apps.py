from django.apps import AppConfig


class ModelsAppConfig(AppConfig):
    name = "models_app"
    verbose_name = "Models"

    def ready(self) -> None:
        from django.db.models.signals import post_migrate

        from mistudio import roles
        from mistudio.access import register_visibility
        from mistudio.metrics import register_database_metrics, register_model_names
        from mistudio.workers import register_worker_hook
        from models_app import metrics, selectors, services
        from models_app.models import LanguageModel

        post_migrate.connect(roles.ensure_role_groups, sender=self)
        selectors.register_event_groups()
        register_database_metrics(metrics.database_metrics)
        register_worker_hook("start", services.worker_started)
        register_worker_hook("every_beat", services.unload_idle_models)
        register_worker_hook("reconcile", services.worker_lost_reconcile)
        register_model_names(metrics.model_names)
        register_visibility(
            LanguageModel, lambda user: selectors.model_list(user=user), code="MODEL_NOT_FOUND", what="model"
        )
