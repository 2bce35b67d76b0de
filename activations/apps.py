from django.apps import AppConfig


class ActivationsConfig(AppConfig):
    name = "activations"
    verbose_name = "Datasets and activations"

    def ready(self) -> None:
        from activations import selectors

        selectors.register_event_groups()
