from django.apps import AppConfig


class MistudioConfig(AppConfig):
    name = "mistudio"
    verbose_name = "miStudio"
