from django.apps import AppConfig


class GenerationConfig(AppConfig):
    name = "generation"
    verbose_name = "Generation"

    def ready(self) -> None:
        from generation import metrics, selectors
        from mistudio.metrics import register_database_metrics

        selectors.register_event_groups()
        register_database_metrics(metrics.database_metrics)
