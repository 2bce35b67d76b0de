from django.apps import AppConfig


class SteeringConfig(AppConfig):
    name = "steering"
    verbose_name = "Steering vectors"

    def ready(self) -> None:
        from django.db.models.signals import pre_delete

        from generation.interventions import register_vector_source
        from mistudio.workers import register_worker_hook
        from steering import selectors, services
        from steering.models import SteeringVector

        register_vector_source(selectors.vector_reference, services.vector_tensor)
        register_worker_hook("start", services.vector_resume_on_worker_start)
        pre_delete.connect(services.vector_files_follow_row, sender=SteeringVector)
