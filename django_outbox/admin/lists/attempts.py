"""The attempts' list, with the job and window pages under it, and the dashboard's entry.

Each attempt row is one execution of a handler. The list marks a redelivery and a
second execution of one delivery beside the attempt's number; the job page and the
window page (``admin.job_page``) hang under its URLs, readable by whoever may read the
attempts, and so does the dashboard (``admin.dashboard``), whose entry in the admin
index is the ``Dashboard`` proxy of the attempts.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import Exists, OuterRef, QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils.html import format_html

from django_outbox.admin import dashboard, job_page
from django_outbox.admin.lists.cancellations import CancelJobs
from django_outbox.admin.lists.read_only import ReadOnlyAdmin, short
from django_outbox.models import Attempt, Dashboard

__all__ = ["AttemptAdmin", "DashboardAdmin"]


@admin.register(Attempt)
class AttemptAdmin(CancelJobs, ReadOnlyAdmin):
    # Fits 1400 px beside the navigation and the filters: ids cut to one line (the
    # whole value in the title), the attempt's marks beside its number and its error
    # beside its outcome, where each is read.
    list_display = (
        "started_at",
        "task",
        "key",
        "number",
        "ending",
        "worker",
        "job",
    )
    list_filter = ("outcome", "task_name", "redelivered", "app_version")
    # "Cancel these jobs": each selected row's job, by its task id (a retry of it is
    # the same task id). Its checkbox column fits 1400 px beside the rest because the
    # worker and the duration share a column and the key is cut to 24 characters (the
    # browser test measures it).
    actions = ("cancel_jobs",)
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
        """The job page: explain's timeline and verdict (``admin.job_page``)."""
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
        return short(obj.idempotency_key, keep=24)

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

    @admin.display(description="worker, duration", ordering="duration_ms")
    def worker(self, obj: Attempt) -> str:
        # One column for both, so the action checkbox fits 1400 px.
        return format_html(
            "{} pid {}<br>{} ms", obj.worker_host, obj.worker_pid, f"{round(obj.duration_ms):,}"
        )

    @admin.display(description="delivery")
    def marks(self, obj: Attempt) -> str:
        marks = []
        if obj.redelivered:
            marks.append("redelivered")
        if getattr(obj, "repeated", False):
            marks.append("second execution")
        return ", ".join(marks) or "-"


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
