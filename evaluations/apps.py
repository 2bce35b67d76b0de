from django.apps import AppConfig


class EvaluationsConfig(AppConfig):
    name = "evaluations"
    verbose_name = "SAEBench evaluations"

    def ready(self) -> None:
        from evaluations import selectors, serializers
        from evaluations.apis import BENCH_API
        from evaluations.models import BenchRun
        from mistudio.access import register_visibility
        from mistudio.jobs import register_job_kind

        selectors.register_event_groups()
        register_visibility(
            BenchRun,
            lambda user: selectors.bench_run_list(user=user),
            code="BENCH_NOT_FOUND",
            what="SAEBench run",
        )
        register_job_kind(
            BenchRun,
            state=serializers.bench_event_state,
            serializer=serializers.BenchOutputSerializer,
            api=BENCH_API,
        )
