from django.apps import AppConfig


class SaesConfig(AppConfig):
    name = "saes"
    verbose_name = "Sparse autoencoders"

    def ready(self) -> None:
        from generation.interventions import register_sae_source
        from mistudio.access import register_visibility
        from mistudio.jobs import register_job_kind
        from saes import selectors, serializers, tasks
        from saes.models import SaeEvaluation, SaeGroup, SparseAutoencoder

        selectors.register_event_groups()
        register_sae_source(selectors.sae_reference, tasks.sae_module_by_id)
        register_visibility(
            SparseAutoencoder, lambda user: selectors.sae_list(user=user), code="SAE_NOT_FOUND", what="SAE"
        )
        register_job_kind(SparseAutoencoder, state=serializers.sae_event_state)
        register_job_kind(SaeEvaluation, state=serializers.evaluation_state)
        register_visibility(
            SaeGroup,
            lambda user: selectors.group_list(user=user),
            code="SAE_GROUP_NOT_FOUND",
            what="SAE group",
        )
        register_job_kind(SaeGroup, state=serializers.sae_group_state)
