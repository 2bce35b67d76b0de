"""What the admin pages of every kind of job share (``mistudio.jobs``): read-only rows (they change
through their services) and one "Cancel selected" action."""

from django.contrib import admin, messages

from mistudio import jobs
from mistudio.access import OPERATOR
from mistudio.errors import ApplicationError


class JobAdmin(admin.ModelAdmin):
    """The admin of a job row; a kind's admin adds its columns and what its owner may change."""

    actions = ["cancel_selected"]

    def has_add_permission(self, request) -> bool:
        return False  # jobs start from the API, the pages or the commands

    @admin.action(description="Cancel selected (queued: at once; running: after the current step)")
    def cancel_selected(self, request, queryset):
        for row in queryset:
            try:
                jobs.job_cancel(row, actor=OPERATOR)
                self.message_user(request, f"{row.pk}: cancelled.")
            except ApplicationError as error:
                self.message_user(request, f"{row.pk}: {error.message}", level=messages.WARNING)
