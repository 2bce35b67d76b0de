"""What the SAE and feature commands share: finding an SAE by id."""

from django.core.management.base import CommandError

from saes.models import SparseAutoencoder


def find_sae(sae_id: str) -> SparseAutoencoder:
    """The SAE with id ``sae_id`` (``sae_…``), or a ``CommandError`` pointing at ``list_saes``."""
    sae = SparseAutoencoder.objects.filter(pk=sae_id).first()
    if sae is None:
        raise CommandError(f"No SAE {sae_id!r} (see `manage.py list_saes`).")
    return sae
