from django.apps import AppConfig


class ModelsAppConfig(AppConfig):
    name = "models_app"
    verbose_name = "Models"

    def ready(self) -> None:
        from django.db.models.signals import post_migrate

        from mistudio.metrics import register_database_metrics
        from models_app import metrics, roles, selectors

        post_migrate.connect(roles.ensure_role_groups, sender=self)
        selectors.register_event_groups()
        register_database_metrics(metrics.database_metrics)
