from django.apps import AppConfig


class ActivationsConfig(AppConfig):
    name = "activations"
    verbose_name = "Datasets and activations"
