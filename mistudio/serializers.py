"""Serializer helpers shared by every app's API."""

from rest_framework import serializers


class StrictSerializer(serializers.Serializer):
    """Unknown fields are an error, not silently ignored (a typo must not pass unnoticed).

    Checked in ``to_internal_value``, so nested strict serializers check their own fields too.
    """

    def to_internal_value(self, data):
        unknown = set(data) - set(self.fields) if hasattr(data, "keys") else set()
        errors = {name: ["Unknown or read-only field."] for name in sorted(unknown)}
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as error:
            if not errors or not isinstance(error.detail, dict):
                raise
            raise serializers.ValidationError({**error.detail, **errors}) from None
        if errors:
            raise serializers.ValidationError(errors)
        return value
