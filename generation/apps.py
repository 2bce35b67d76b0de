from django.apps import AppConfig


class GenerationConfig(AppConfig):
    name = "generation"
    verbose_name = "Generation"

    def ready(self) -> None:
        from generation import metrics, selectors, tasks
        from mistudio.metrics import register_database_metrics
        from mistudio.workers import register_worker_hook

        selectors.register_event_groups()
        register_database_metrics(metrics.database_metrics)
        register_worker_hook("start", tasks.generations_on_worker_start)
        register_worker_hook("reconcile", tasks.generations_reconcile)
        register_worker_hook("interactive_owners", tasks.waiting_owners)
