"""The cancellations' list, and the action that cancels the jobs of selected rows.

``Cancellation`` rows are an operator's decisions (who, when, why), kept as evidence:
read-only here. The action "Cancel these jobs" sits on the dead-letter list, where
each dead letter's jobs are cancelled by its key, so a replay of it does not run either
(``django_outbox.store.cancellations``), and on the attempt list, where each row's job
is cancelled by its task id;
what could not be cancelled (an effect already committed) is said, one message each.
It needs the ``add_cancellation`` permission.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db import DatabaseError
from django.db.models import QuerySet
from django.http import HttpRequest

from django_outbox.admin.lists.read_only import ReadOnlyAdmin
from django_outbox.models import Cancellation
from django_outbox.store import cancellations

__all__ = ["CancellationAdmin", "CancelJobs"]


@admin.register(Cancellation)
class CancellationAdmin(ReadOnlyAdmin):
    """Jobs an operator cancelled: by task id or by idempotency key."""

    list_display = ("requested_at", "task_id", "idempotency_key", "task_name", "requested_by")
    search_fields = ("task_id", "idempotency_key", "requested_by")
    list_filter = ("requested_by",)
    date_hierarchy = "requested_at"


class CancelJobs:
    """The "Cancel these jobs" action, for a list whose rows have a ``task_id`` and an
    ``idempotency_key``. ``cancel_by_key``: cancel every job of each row's key (the
    dead letters': a replay is a new task id of the same key), else the row's task id
    (the attempts': that job)."""

    cancel_by_key = False

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("django_outbox.add_cancellation"))

    @admin.action(permissions=["cancel"], description="Cancel these jobs (before their effect)")
    def cancel_jobs(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        by = request.user.get_username()
        done = 0
        for task_id, key in sorted(set(queryset.values_list("task_id", "idempotency_key"))):
            named = {"key": key} if self.cancel_by_key and key else {"task_id": task_id}
            try:
                _row, new = cancellations.cancel(**named, by=by)
            except (cancellations.NotCancelled, DatabaseError) as exc:
                what = f"key {key}" if "key" in named else f"task {task_id}"
                self.message_user(request, f"{what}: {exc}", messages.WARNING)  # type: ignore[attr-defined]
                continue
            done += int(new)
        self.message_user(request, f"Cancelled {done} job(s).", messages.SUCCESS)  # type: ignore[attr-defined]
