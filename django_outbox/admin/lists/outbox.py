"""The outbox events' list: the backlog and its age in the title, "retry now" as an action.

Rows are the relay's evidence, so read-only; the page shows a task's sensitive
arguments redacted (``admin.replay.shown_arguments``).
"""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin, messages
from django.db import connections, transaction
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils import timezone

from django_outbox.admin import dashboard
from django_outbox.admin import replay as admin_replay
from django_outbox.admin.lists.read_only import ReadOnlyAdmin
from django_outbox.conf import settings
from django_outbox.db import outbox_sql
from django_outbox.models import OutboxEvent, OutboxStatus

__all__ = ["OutboxEventAdmin"]


@admin.register(OutboxEvent)
class OutboxEventAdmin(ReadOnlyAdmin):
    """Outbox events: the backlog and its age in the title, per-event attempts and error.

    Rows are the relay's evidence, so read-only; "retry now" (its own permission) only
    moves a pending event's backoff to now and wakes the relays.
    """

    list_display = (
        "id",
        "created_at",
        "task_name",
        "status",
        "ordering_key",
        "attempts",
        "available_at",
        "published_at",
        "republished",
        "error",
    )
    list_filter = ("status", "task_name")
    search_fields = ("=event_id", "=ordering_key", "=task_name")
    date_hierarchy = "created_at"
    actions = ("retry_now",)

    @admin.display(description="last error")
    def error(self, event: OutboxEvent) -> str:
        return event.last_error[:120]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[Any]:
        # The row keeps a task's sensitive arguments (the relay publishes from it);
        # the page shows them redacted.
        shown = {"args": "arguments", "kwargs": "keyword_arguments"}
        return [
            shown.get(f, f) if isinstance(f, str) else f for f in super().get_fields(request, obj)
        ]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[Any]:
        return [*super().get_readonly_fields(request, obj), "arguments", "keyword_arguments"]

    @admin.display(description="args")
    def arguments(self, event: OutboxEvent) -> str:
        return json.dumps(admin_replay.shown_arguments(event)[0])

    @admin.display(description="kwargs")
    def keyword_arguments(self, event: OutboxEvent) -> str:
        return json.dumps(admin_replay.shown_arguments(event)[1])

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> TemplateResponse:
        count, oldest = OutboxEvent.objects.using(self.get_queryset(request).db).backlog()
        if oldest is None:
            summary = "backlog: none pending"
        else:
            age = (timezone.now() - oldest).total_seconds()
            summary = f"backlog: {count} pending, oldest {dashboard.age_text(age)} old"
        context = {"title": f"Outbox events ({summary})", **(extra_context or {})}
        response: TemplateResponse = super().changelist_view(request, context)  # type: ignore[assignment]
        return response

    def has_retry_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("django_outbox.retry_outboxevent"))

    @admin.action(permissions=["retry"], description="Retry now (end the backoff)")
    def retry_now(self, request: HttpRequest, queryset: QuerySet[OutboxEvent]) -> None:
        alias = queryset.db
        with transaction.atomic(using=alias):
            done = queryset.filter(status=OutboxStatus.PENDING).update(available_at=Now())
            channel = settings.outbox_notify_channel
            if done and channel and connections[alias].vendor == "postgresql":
                with connections[alias].cursor() as cursor:
                    cursor.execute(outbox_sql.NOTIFY, [channel])
        self.message_user(
            request, f"{done} pending outbox event(s) will be published now.", messages.SUCCESS
        )
