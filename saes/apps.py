from typing import Any

from django.apps import AppConfig


def sae_module_by_id(sae_id: str) -> Any:
    """The loaded SAE module of a row, for interventions: worker-side code (it imports torch), imported
    when a worker first asks, so that the web process never imports torch."""
    from saes.tasks import sae_module_by_id as load

    return load(sae_id)


class SaesConfig(AppConfig):
    name = "saes"
    verbose_name = "Sparse autoencoders"

    def ready(self) -> None:
        from generation.interventions import register_sae_source
        from mistudio.access import register_visibility
        from mistudio.jobs import register_job_kind
        from saes import selectors, serializers
        from saes.apis import SAE_API, SAE_GROUP_API
        from saes.models import SaeEvaluation, SaeGroup, SparseAutoencoder

        selectors.register_event_groups()
        register_sae_source(selectors.sae_reference, sae_module_by_id)
        register_visibility(
            SparseAutoencoder, lambda user: selectors.sae_list(user=user), code="SAE_NOT_FOUND", what="SAE"
        )
        register_job_kind(
            SparseAutoencoder,
            state=serializers.sae_event_state,
            serializer=serializers.SaeOutputSerializer,
            api=SAE_API,
        )
        register_job_kind(SaeEvaluation, state=serializers.evaluation_state)
        register_visibility(
            SaeGroup,
            lambda user: selectors.group_list(user=user),
            code="SAE_GROUP_NOT_FOUND",
            what="SAE group",
        )
        register_job_kind(
            SaeGroup,
            state=serializers.sae_group_state,
            serializer=serializers.SaeGroupOutputSerializer,
            api=SAE_GROUP_API,
        )
