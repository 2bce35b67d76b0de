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


class OutputSerializer(serializers.Serializer):
    """Describes a JSON body the API answers (a row's ``*_state()`` dict), for the schema.

    Every field is read-only, hence required in the schema, except those declared
    ``required=False``: keys a row's JSON leaves out in some views (a list's shorter rows).
    """

    def get_fields(self):
        fields = super().get_fields()
        for field in fields.values():
            field.read_only = field.read_only or field.required
        return fields


class JobOutputSerializer(OutputSerializer):
    """What every job row's JSON tells of its run, owner and times (``mistudio.jobs.JobRow``)."""

    status = serializers.CharField(help_text="queued, running, completed, failed or cancelled")
    progress = serializers.FloatField()
    host_worker = serializers.CharField(allow_blank=True)
    error_code = serializers.CharField(allow_blank=True)
    error_message = serializers.CharField(allow_blank=True)
    owner = serializers.CharField(allow_null=True, help_text="The owner's username")
    shared = serializers.BooleanField()
    created_at = serializers.DateTimeField(allow_null=True)
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)
    queue = serializers.DictField(
        required=False,
        allow_null=True,
        help_text="Its row's GET while queued: position (1: next), ahead and running (kind; id and owner "
        "where the caller may see them), starts_in_seconds (null: unknown); null once it runs",
    )


# The collections ``GET /api/`` links to, by URL name (``mistudio.urls.api_root``).
API_ROOT_LINKS = (
    "model-list",
    "dataset-list",
    "extraction-list",
    "cache-list",
    "sae-list",
    "worker-list",
    "schema",
)


class ApiRootOutputSerializer(OutputSerializer):
    """``GET /api/``: the versions, a link to each collection (keyed by URL name) and the kinds of job."""

    version = serializers.CharField()
    api_version = serializers.IntegerField()
    jobs = serializers.DictField(
        child=serializers.DictField(child=serializers.CharField()),
        required=False,
        help_text="Per kind of job: its id prefix, detail and cancel paths, and the id's parameter",
    )

    def get_fields(self):
        fields = super().get_fields()
        fields.update({name: serializers.URLField(read_only=True) for name in API_ROOT_LINKS})
        return fields
