"""Admin: evidence is read-only; acting on a dead letter is an explicit, permitted action."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db import connections, models, transaction
from django.db.models import Exists, OuterRef, QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils import timezone
from django.utils.html import format_html

from django_outbox import times
from django_outbox.admin import dashboard, job_page
from django_outbox.admin import replay as admin_replay
from django_outbox.conf import settings
from django_outbox.models import (
    Attempt,
    Dashboard,
    DeadLetter,
    DeadLetterStatus,
    Fence,
    OutboxEvent,
    OutboxStatus,
    ProcessedOperation,
)
from django_outbox.store import dead_letters


def _time_column(field: models.DateTimeField[Any, Any]) -> Callable[[Any], str]:
    """A list column and page field showing ``field`` as every incident tool writes a
    time (``times.shown``: milliseconds, UTC), sorting by the field itself."""
    name = field.name

    @admin.display(description=str(field.verbose_name), ordering=name)
    def column(obj: Any) -> str:
        return times.shown(getattr(obj, name))

    return column


def short(value: str, *, keep: int = 8) -> str:
    """A long id cut to its first ``keep`` characters on one line, the whole of it in
    the title (hover) and kept for copying: a list column of 36-character task ids
    either scrolls or wraps each over several lines."""
    if not value:
        return "-"
    if len(value) <= keep + 1:
        return format_html('<span style="white-space: nowrap">{}</span>', value)
    return format_html(
        '<span title="{}" style="white-space: nowrap">{}…</span>', value, value[:keep]
    )


class ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Rows written by workers are evidence: nobody edits, adds or deletes them here.

    Every time field, in the list and on the row's page, is shown by ``times.shown``
    (``2026-12-02 07:19:45.160 UTC``) under the name ``<field>_utc``: Django's own
    rendering would write ``Dec. 2, 2026, 7:19 a.m.`` in ``TIME_ZONE``, and an incident
    is read across pages, logs and Redis that all write UTC to the millisecond.
    """

    def __init__(self, model: type[models.Model], admin_site: admin.AdminSite) -> None:
        super().__init__(model, admin_site)
        self.time_fields = {
            f.name: f"{f.name}_utc"
            for f in model._meta.get_fields()
            if isinstance(f, models.DateTimeField)
        }
        for name, shown in self.time_fields.items():
            field = model._meta.get_field(name)
            assert isinstance(field, models.DateTimeField)
            setattr(self, shown, _time_column(field))
        self.list_display = tuple(
            self.time_fields.get(c, c) if isinstance(c, str) else c for c in self.list_display
        )

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[Any]:
        return [
            self.time_fields.get(f, f) if isinstance(f, str) else f
            for f in super().get_fields(request, obj)
        ]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[Any]:
        return [*super().get_readonly_fields(request, obj), *self.time_fields.values()]

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(ProcessedOperation)
class ProcessedOperationAdmin(ReadOnlyAdmin):
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


@admin.register(Attempt)
class AttemptAdmin(ReadOnlyAdmin):
    # Fits 1400 px beside the navigation and the filters: ids cut to one line (the
    # whole value in the title), the attempt's marks beside its number and its error
    # beside its outcome, where each is read.
    list_display = (
        "started_at",
        "task",
        "key",
        "number",
        "ending",
        "duration",
        "worker",
        "job",
    )
    list_filter = ("outcome", "task_name", "redelivered")
    search_fields = ("idempotency_key", "task_id__exact", "correlation_id__exact")
    date_hierarchy = "started_at"
    # Tighter cells than the admin's own: the list must fit 1400 px.
    change_list_template = "admin/django_outbox/attempt/change_list.html"

    def get_urls(self) -> list[URLPattern]:
        job = path(
            "job/",
            self.admin_site.admin_view(self.job_view),
            name="django_outbox_job",
        )
        window = path(
            "window/",
            self.admin_site.admin_view(self.window_view),
            name="django_outbox_window",
        )
        return [job, window, *super().get_urls()]

    def job_view(self, request: HttpRequest) -> TemplateResponse:
        """The job page: explain's timeline and verdict (``admin_job``)."""
        self._may_view(request)
        return job_page.job_view(self, request)

    def window_view(self, request: HttpRequest) -> TemplateResponse:
        """The window page: every job with something unusual in a time window."""
        self._may_view(request)
        return job_page.window_view(self, request)

    def _may_view(self, request: HttpRequest) -> None:
        if not self.has_view_permission(request):
            from django.core.exceptions import PermissionDenied

            raise PermissionDenied

    @admin.display(description="explain")
    def job(self, obj: Attempt) -> str:
        return job_page.job_link(obj.idempotency_key or obj.task_id)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Attempt]:
        # An earlier row with the same task id and attempt number: this one is a second
        # execution of one delivery (a duplicate publish, a takeover), not a retry.
        earlier = Attempt.objects.filter(
            task_id=OuterRef("task_id"),
            attempt=OuterRef("attempt"),
            started_at__lt=OuterRef("started_at"),
        )
        rows: QuerySet[Attempt] = super().get_queryset(request)
        return rows.annotate(repeated=Exists(earlier))

    @admin.display(description="idempotency key", ordering="idempotency_key")
    def key(self, obj: Attempt) -> str:
        return short(obj.idempotency_key, keep=28)

    @admin.display(description="task, task id", ordering="task_name")
    def task(self, obj: Attempt) -> str:
        return format_html("{}<br>{}", obj.task_name, short(obj.task_id))

    @admin.display(description="attempt", ordering="attempt")
    def number(self, obj: Attempt) -> str:
        marks = self.marks(obj)
        return str(obj.attempt) if marks == "-" else f"{obj.attempt}: {marks}"

    @admin.display(description="outcome", ordering="outcome")
    def ending(self, obj: Attempt) -> str:
        # The error class's own name says what failed; its module and the message are
        # in the title.
        outcome = obj.get_outcome_display()
        if not obj.error_class:
            return outcome
        return format_html(
            '{}: <span title="{}" style="white-space: nowrap">{}</span>',
            outcome,
            f"{obj.error_class}: {obj.error_message}"[:300],
            obj.error_class.rsplit(".", 1)[-1],
        )

    @admin.display(description="duration", ordering="duration_ms")
    def duration(self, obj: Attempt) -> str:
        return f"{round(obj.duration_ms):,} ms"

    @admin.display(description="worker")
    def worker(self, obj: Attempt) -> str:
        return f"{obj.worker_host} pid {obj.worker_pid}"

    @admin.display(description="delivery")
    def marks(self, obj: Attempt) -> str:
        marks = []
        if obj.redelivered:
            marks.append("redelivered")
        if getattr(obj, "repeated", False):
            marks.append("second execution")
        return ", ".join(marks) or "-"


class DeadLetterStatusFilter(admin.SimpleListFilter):
    """Open letters unless asked otherwise: the list is opened to act on what still
    needs a person. "every status" clears it (and is kept in the URL, so it stays
    cleared while searching and paging)."""

    title = "status"
    parameter_name = "status"
    EVERY = "every"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [*DeadLetterStatus.choices, (self.EVERY, "every status")]

    def __init__(
        self, request: HttpRequest, params: dict[str, Any], model: Any, model_admin: Any
    ) -> None:
        super().__init__(request, params, model, model_admin)
        # The default is for reading the list. An action posted here acts on exactly
        # the letters selected: the letter's own page posts without the filter, and a
        # refusal must name a closed letter rather than drop it silently.
        self.default = DeadLetterStatus.OPEN.value if request.method == "GET" else self.EVERY

    def value(self) -> str:
        return str(super().value() or self.default)

    def choices(self, changelist: Any) -> Any:
        # No "All" entry of Django's own: without the parameter the list is the open
        # letters, so "every status" is an explicit choice like the others.
        for lookup, title in self.lookup_choices:
            yield {
                "selected": self.value() == str(lookup),
                "query_string": changelist.get_query_string(
                    {self.parameter_name: lookup}, [self.parameter_name]
                ),
                "display": title,
            }

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == self.EVERY:
            return queryset
        return queryset.filter(status=self.value())


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
        "job",
    )
    list_filter = (DeadLetterStatusFilter, "reason", "task_name")
    search_fields = ("idempotency_key", "task_id")
    date_hierarchy = "last_attempt"
    actions = ("replay", "discard")
    readonly_fields = ("effect_happened",)
    change_form_template = "admin/django_outbox/deadletter/change_form.html"

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[Any]:
        # "Did the effect happen?" first: the question a dead letter is opened for.
        fields = [f for f in super().get_fields(request, obj) if f != "effect_happened"]
        return ["effect_happened", *fields]

    @admin.display(description="effect happened")
    def effect_happened(self, obj: DeadLetter) -> str:
        applied = ProcessedOperation.objects.filter(key=obj.idempotency_key).first()
        answer = (
            f"Yes: applied at {times.shown(applied.processed_at)} by task {applied.task_id}."
            if obj.idempotency_key and applied is not None
            else "No: no ledger row for its key."
        )
        return format_html(
            "{} {}", answer, job_page.job_link(obj.idempotency_key or obj.task_id, "Explain.")
        )

    @admin.display(description="explain")
    def job(self, obj: DeadLetter) -> str:
        return job_page.job_link(obj.idempotency_key or obj.task_id)

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("django_outbox.replay_deadletter"))

    def has_discard_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("django_outbox.discard_deadletter"))

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> Any:
        # Replay and discard offered on the letter's own page; each goes through the
        # same confirmation page as the list's actions.
        context = {
            "can_replay": self.has_replay_permission(request),
            "can_discard": self.has_discard_permission(request),
            **(extra_context or {}),
        }
        return super().change_view(request, object_id, form_url, context)

    @admin.action(permissions=["replay"], description="Replay (same idempotency key)")
    def replay(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> Any:
        if request.POST.get("post") != "yes":
            return self._confirm(request, queryset, "replay")
        done = 0
        for letter in queryset:
            # A letter that is not open, or a conflict, is refused with its reason (one
            # warning each): "Replayed 0" alone would not say why.
            try:
                new_id = dead_letters.replay(letter, by=request.user.get_username())
            except ValueError as exc:
                self.message_user(request, str(exc), messages.WARNING)
                continue
            self.log_change(request, letter, f"Replayed as task {new_id}.")
            done += 1
        self.message_user(request, f"Replayed {done} dead letter(s).", messages.SUCCESS)
        return None

    @admin.action(permissions=["discard"], description="Discard (keep as evidence)")
    def discard(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> Any:
        if request.POST.get("post") != "yes":
            return self._confirm(request, queryset, "discard")
        done = 0
        for letter in queryset:
            try:
                dead_letters.discard(letter, by=request.user.get_username())
            except ValueError as exc:
                self.message_user(request, str(exc), messages.WARNING)
                continue
            self.log_change(request, letter, "Discarded (kept as evidence).")
            done += 1
        self.message_user(request, f"Discarded {done} dead letter(s).", messages.SUCCESS)
        return None

    def _confirm(
        self, request: HttpRequest, queryset: QuerySet[DeadLetter], action: str
    ) -> TemplateResponse:
        """What the action will do to each selected letter, before it does anything.

        Django's own convention (as ``delete_selected``): the action posted without
        ``post=yes`` shows this page; its button posts again with ``post=yes``.
        """
        rows = [admin_replay.plan(letter, action) for letter in queryset.order_by("pk")]
        context = {
            **self.admin_site.each_context(request),
            "title": f"{action.capitalize()} dead letters: are you sure?",
            "action": action,
            "rows": rows,
            "ready": sum(1 for r in rows if not r["refusal"]),
            "opts": self.model._meta,
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(
            request, "admin/django_outbox/deadletter/confirm_action.html", context
        )


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
                    cursor.execute("SELECT pg_notify(%s, '')", [channel])
        self.message_user(
            request, f"{done} pending outbox event(s) will be published now.", messages.SUCCESS
        )


@admin.register(Dashboard)
class DashboardAdmin(ReadOnlyAdmin):
    """The dashboard, in the admin index's list (``django_outbox.admin.dashboard``), and the
    metrics of the stored state beside it (``django_outbox.incident.metrics_view``)."""

    def get_urls(self) -> list[URLPattern]:
        from django_outbox.incident.metrics_view import metrics_view

        # Not wrapped in admin_view: Prometheus has no session; the view checks its
        # bearer token (EXPLICIT_METRICS_TOKEN) and answers 404 while none is set.
        # Before the model's own patterns, whose last one takes any path as an id.
        return [
            path("metrics/", metrics_view, name="django_outbox_dashboard_metrics"),
            *super().get_urls(),
        ]

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(request.user.has_perm("django_outbox.view_attempt")) or bool(
            super().has_view_permission(request, obj)
        )

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> TemplateResponse:
        if not self.has_view_permission(request):
            from django.core.exceptions import PermissionDenied

            raise PermissionDenied
        return dashboard.dashboard_view(self, request)
