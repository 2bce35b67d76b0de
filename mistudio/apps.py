from django.apps import AppConfig


class MistudioConfig(AppConfig):
    name = "mistudio"
    verbose_name = "miStudio"

    def ready(self) -> None:
        from django.contrib.auth import get_user_model
        from django.db.models.signals import pre_delete

        from mistudio import access, job_runner, jobs
        from mistudio.metrics import register_database_metrics
        from mistudio.workers import register_worker_hook

        register_worker_hook("start", jobs.jobs_resume_on_worker_start)
        register_worker_hook("batch_owners", job_runner.waiting_owners)
        register_database_metrics(jobs.job_metrics)
        pre_delete.connect(access.withhold_rows_of_deleted_user, sender=get_user_model())
