"""Rows of the platform itself (not of a research object): a user's named API tokens."""

import binascii
import os

from django.conf import settings
from django.db import models


def new_token_key() -> str:
    return binascii.hexlify(os.urandom(20)).decode()  # as DRF's Token: 40 hex characters


class ApiToken(models.Model):
    """One of a user's API tokens, named (``laptop notebook``, ``CI``) so that several can live side
    by side and each be revoked alone. Sent as ``Authorization: Bearer <key>`` (or ``Token``), like
    DRF's single token, which keeps working. The key is shown once, when it is made."""

    key = models.CharField(max_length=40, unique=True, default=new_token_key, editable=False)
    name = models.CharField(max_length=100)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [models.UniqueConstraint(fields=["user", "name"], name="api_token_unique_name")]

    def __str__(self) -> str:
        return f"{self.user_id}: {self.name}"
