"""Admin: evidence is read-only; acting on a dead letter is an explicit, permitted action."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from django_outbox import dead_letters
from django_outbox.models import Attempt, DeadLetter, DeadLetterStatus, ProcessedOperation


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
