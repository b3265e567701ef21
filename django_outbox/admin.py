"""Admin: evidence is read-only; acting on a dead letter is an explicit, permitted action."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db import connections, transaction
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils import timezone

from django_outbox import dead_letters
from django_outbox.conf import settings
from django_outbox.models import (
    Attempt,
    DeadLetter,
    DeadLetterStatus,
    OutboxEvent,
    OutboxStatus,
    ProcessedOperation,
)


class ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Rows written by workers are evidence: nobody edits, adds or deletes them here."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(ProcessedOperation)
class ProcessedOperationAdmin(ReadOnlyAdmin):
    list_display = ("key", "task_name", "processed_at", "result_ref", "task_id")
    search_fields = ("=key", "=task_id", "result_ref")
    list_filter = ("task_name",)
    date_hierarchy = "processed_at"


@admin.register(Attempt)
class AttemptAdmin(ReadOnlyAdmin):
    list_display = (
        "started_at",
        "task_name",
        "idempotency_key",
        "attempt",
        "outcome",
        "redelivered",
        "duration_ms",
        "error_class",
        "worker_host",
        "worker_pid",
    )
    list_filter = ("outcome", "task_name", "redelivered")
    search_fields = ("=idempotency_key", "=task_id", "=correlation_id", "=external_request_id")
    date_hierarchy = "started_at"


@admin.register(DeadLetter)
class DeadLetterAdmin(ReadOnlyAdmin):
    list_display = (
        "last_attempt",
        "task_name",
        "reason",
        "status",
        "idempotency_key",
        "error_class",
        "attempts",
    )
    list_filter = ("status", "reason", "task_name")
    search_fields = ("=idempotency_key", "=task_id", "=correlation_id")
    date_hierarchy = "last_attempt"
    actions = ("replay", "discard")

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("django_outbox.replay_deadletter"))

    def has_discard_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("django_outbox.discard_deadletter"))

    @admin.action(permissions=["replay"], description="Replay (same idempotency key)")
    def replay(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> None:
        done = 0
        for letter in queryset.filter(status=DeadLetterStatus.OPEN):
            try:
                dead_letters.replay(letter, by=request.user.get_username())
            except ValueError as exc:
                self.message_user(request, str(exc), messages.WARNING)
                continue
            done += 1
        self.message_user(request, f"Replayed {done} dead letter(s).", messages.SUCCESS)

    @admin.action(permissions=["discard"], description="Discard (keep as evidence)")
    def discard(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> None:
        done = 0
        for letter in queryset.filter(status=DeadLetterStatus.OPEN):
            try:
                dead_letters.discard(letter, by=request.user.get_username())
            except ValueError as exc:
                self.message_user(request, str(exc), messages.WARNING)
                continue
            done += 1
        self.message_user(request, f"Discarded {done} dead letter(s).", messages.SUCCESS)


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
        "error",
    )
    list_filter = ("status", "task_name")
    search_fields = ("=event_id", "=ordering_key", "=task_name")
    date_hierarchy = "created_at"
    actions = ("retry_now",)

    @admin.display(description="last error")
    def error(self, event: OutboxEvent) -> str:
        return event.last_error[:120]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> TemplateResponse:
        count, oldest = OutboxEvent.objects.using(self.get_queryset(request).db).backlog()
        if oldest is None:
            summary = "backlog: none pending"
        else:
            age = (timezone.now() - oldest).total_seconds()
            summary = f"backlog: {count} pending, oldest {_age(age)} old"
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
                    cursor.execute("SELECT pg_notify(%s, '')", [channel])
        self.message_user(
            request, f"{done} pending outbox event(s) will be published now.", messages.SUCCESS
        )


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"
