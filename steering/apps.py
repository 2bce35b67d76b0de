from django.apps import AppConfig


class SteeringConfig(AppConfig):
    name = "steering"
    verbose_name = "Steering vectors"

    def ready(self) -> None:
        from generation.interventions import register_vector_source
        from mistudio.access import register_visibility
        from mistudio.jobs import register_job_kind
        from steering import selectors, serializers, services
        from steering.apis import VECTOR_API
        from steering.models import SteeringVector

        selectors.register_event_groups()
        register_vector_source(selectors.vector_reference, services.vector_tensor)
        register_visibility(
            SteeringVector,
            lambda user: selectors.vector_list(user=user),
            code="STEERING_VECTOR_NOT_FOUND",
            what="steering vector",
        )
        register_job_kind(
            SteeringVector,
            state=serializers.vector_event_state,
            serializer=serializers.VectorOutputSerializer,
            api=VECTOR_API,
        )
