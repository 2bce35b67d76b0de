from django.apps import AppConfig


class SaesConfig(AppConfig):
    name = "saes"
    verbose_name = "Sparse autoencoders"

    def ready(self) -> None:
        from django.db.models.signals import pre_delete

        from generation.interventions import register_sae_source
        from mistudio.workers import register_worker_hook
        from saes import selectors, services, tasks
        from saes.models import SparseAutoencoder

        selectors.register_event_groups()
        register_sae_source(selectors.sae_reference, tasks.sae_module_by_id)
        register_worker_hook("start", services.sae_resume_on_worker_start)
        pre_delete.connect(services.sae_files_follow_row, sender=SparseAutoencoder)
