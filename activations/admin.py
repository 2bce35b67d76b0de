from django.contrib import admin

from activations import services
from activations.models import ActivationCache, Dataset, ExtractionJob
from mistudio.admin import JobAdmin


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = ["id", "name", "source", "format", "sample_count", "size_bytes", "created_at"]
    list_filter = ["source", "format"]
    search_fields = ["id", "name", "content_hash", "original_name"]
    readonly_fields = [
        "id", "source", "original_name", "format", "field", "sample_count", "size_bytes", "content_hash",
        "preview", "owner", "created_at",
    ]  # fmt: skip

    def has_add_permission(self, request) -> bool:
        return False  # parsing and storage go through the API, the pages or `manage.py add_dataset`

    def delete_model(self, request, obj) -> None:
        services.dataset_delete(dataset_id=obj.pk)


@admin.register(ExtractionJob)
class ExtractionJobAdmin(JobAdmin):
    list_display = [
        "id",
        "model",
        "dataset",
        "status",
        "progress",
        "tokens_per_second",
        "cached",
        "created_at",
    ]
    list_filter = ["status", "cached", "dtype"]
    search_fields = ["id", "model__name", "dataset__name"]
    readonly_fields = [field.name for field in ExtractionJob._meta.fields]


@admin.register(ActivationCache)
class ActivationCacheAdmin(admin.ModelAdmin):
    list_display = ["id", "model", "dataset", "status", "num_tokens", "file_size_bytes", "last_accessed_at"]
    list_filter = ["status", "source", "dtype"]
    search_fields = ["id", "model__name", "key_hash"]
    readonly_fields = [field.name for field in ActivationCache._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False

    def delete_model(self, request, obj) -> None:
        services.cache_delete(cache_id=obj.pk)

    def delete_queryset(self, request, queryset) -> None:
        for cache in queryset:
            services.cache_delete(cache_id=cache.pk)
