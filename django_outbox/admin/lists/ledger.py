"""The ledger's list, and the fences': what a job committed, and who may still commit.

A ledger entry says an effect happened (its key, when, by which task); a fence says a
newer execution took a job's lease over, so an older one's commit is refused.
"""

from __future__ import annotations

from django.contrib import admin

from django_outbox.admin import job_page
from django_outbox.admin.lists.read_only import ReadOnlyAdmin
from django_outbox.models import Fence, ProcessedOperation

__all__ = ["FenceAdmin", "LedgerAdmin"]


@admin.register(ProcessedOperation)
class LedgerAdmin(ReadOnlyAdmin):
    """The ledger: one ledger entry per idempotency key whose effect committed."""

    list_display = ("key", "task_name", "processed_at", "result_ref", "task_id", "job")
    # Substring search: an order number finds every key it is part of.
    search_fields = ("key", "task_id__exact")
    list_filter = ("task_name",)
    date_hierarchy = "processed_at"

    @admin.display(description="explain")
    def job(self, obj: ProcessedOperation) -> str:
        return job_page.job_link(obj.key)


@admin.register(Fence)
class FenceAdmin(ReadOnlyAdmin):
    """Lease takeovers: the newest fencing token of a job; an older execution's commit
    is refused."""

    list_display = ("task_id", "idempotency_key", "token", "taken_over_from", "taken_over_at")
    search_fields = ("task_id", "idempotency_key", "taken_over_from")
    date_hierarchy = "taken_over_at"
