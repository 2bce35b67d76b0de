from django.apps import AppConfig


class ActivationsConfig(AppConfig):
    name = "activations"
    verbose_name = "Datasets and activations"

    def ready(self) -> None:
        from activations import metrics, selectors
        from mistudio.metrics import register_database_metrics

        selectors.register_event_groups()
        register_database_metrics(metrics.database_metrics)
