from django.contrib import admin

from activations.models import Dataset


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = ["id", "name", "source", "sample_count", "size_bytes", "created_at"]
    list_filter = ["source"]
    search_fields = ["id", "name", "content_hash"]
    readonly_fields = ["id", "sample_count", "size_bytes", "content_hash", "created_at"]
