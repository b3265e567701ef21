"""The job page: ``manage.py explicit_explain`` in the admin, with every row linked.

``/admin/django_outbox/attempt/job/?q=<what>`` takes what ``explain`` takes (a key, a
task id, a dead letter id, an outbox event id, a business id) and shows each matching
job's verdict first (with the rule it matched by), then its timeline, each line with the
span since the one before; every event links to its row (an execution that left no
attempt row, to the fence of its takeover). Attempts, dead letters and ledger entries link
here from their lists.

``/admin/django_outbox/attempt/window/?since=02:50&until=03:20`` is ``manage.py explicit_explain
--since/--until`` in the admin: every job with something unusual in the window, grouped
by cause, each linked to its job page.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, reverse
from django.utils import timezone
from django.utils.html import format_html

from django_outbox import times
from django_outbox.incident import explain, window
from django_outbox.models import Attempt, OutboxEvent, ProcessedOperation


def job_url(what: str) -> str:
    return reverse("admin:django_outbox_job") + "?" + urlencode({"q": what})


def job_link(what: str, label: str = "job") -> str:
    """A link to the job page of ``what`` (for a list column)."""
    if not what:
        return "-"
    return format_html('<a href="{}">{}</a>', job_url(what), label)


def job_view(model_admin: Any, request: HttpRequest) -> TemplateResponse:
    query = (request.GET.get("q") or "").strip()
    found: list[dict[str, Any]] = []
    error = ""
    if query:
        try:
            found = [_page(e) for e in explain.explain(query)]
        except explain.ExplainError as exc:
            error = str(exc)
    context = {
        **model_admin.admin_site.each_context(request),
        "title": f"Job: {query}" if query else "Explain a job",
        "query": query,
        "jobs": found,
        "error": error,
        "opts": model_admin.model._meta,
    }
    return TemplateResponse(request, "admin/django_outbox/job.html", context)


def window_view(model_admin: Any, request: HttpRequest) -> TemplateResponse:
    since_text = (request.GET.get("since") or "").strip()
    until_text = (request.GET.get("until") or "").strip()
    report: window.Window | None = None
    error = ""
    if since_text:
        try:
            start = window.parse_time(since_text)
            end = window.parse_time(until_text) if until_text else timezone.now()
            report = window.report(start, end)
        except ValueError as exc:
            error = str(exc)
    groups = []
    if report is not None:
        for group in report.groups:
            named = group.named(window.DEFAULT_LIMIT)
            groups.append(
                {
                    "label": group.label,
                    "events": group.events,
                    "jobs": len(group.jobs),
                    "more": len(group.jobs) - len(named),
                    "named": [
                        {
                            "at": times.shown(j.first_at),
                            "key": j.key,
                            "task": f"{j.task_name}[{j.task_id}]",
                            "events": j.events,
                            "url": job_url(j.key),
                        }
                        for j in named
                    ],
                }
            )
    context = {
        **model_admin.admin_site.each_context(request),
        "title": "What was unusual in a time window",
        "since": since_text,
        "until": until_text,
        "report": report,
        "summary": report.as_text().splitlines()[0] if report is not None else "",
        "groups": groups,
        "error": error,
        "opts": model_admin.model._meta,
    }
    return TemplateResponse(request, "admin/django_outbox/window.html", context)


def _page(found: explain.Explanation) -> dict[str, Any]:
    return {
        "key": found.key,
        "task_ids": found.task_ids,
        "verdict": found.verdict,
        "matched_by": found.matched_by,
        "events": [
            {
                "at": times.shown(e.at),
                "since": "" if e.since is None else f"+{e.since:.3f} s",
                "kind": e.kind,
                "text": e.text,
                "url": _row_url(e),
            }
            for e in found.events
        ],
    }


def _row_url(event: explain.Event) -> str:
    """The admin page of the row an event came from, where there is one."""
    data = event.data
    try:
        if event.kind in ("dead_letter", "dead_letter_closed"):
            return reverse("admin:django_outbox_deadletter_change", args=[data["dead_letter"]])
        if event.kind == "effect":
            row = ProcessedOperation.objects.filter(task_id=data["task_id"]).first()
            if row is None:
                return ""
            return reverse("admin:django_outbox_processedoperation_change", args=[row.pk])
        if event.kind == "attempt":
            attempt = Attempt.objects.filter(
                task_id=data["task_id"], attempt=data["attempt"]
            ).first()
            if attempt is None:
                return ""
            return reverse("admin:django_outbox_attempt_change", args=[attempt.pk])
        if event.kind in ("outbox", "published"):
            rows = OutboxEvent.objects.filter(event_id=data["event_id"])
            row_id = rows.values_list("pk", flat=True).first()
            if row_id is None:
                return ""
            return reverse("admin:django_outbox_outboxevent_change", args=[row_id])
        if event.kind == "cancelled":
            query = urlencode({"q": data["task_id"] or data["key"]})
            return reverse("admin:django_outbox_cancellation_changelist") + f"?{query}"
        if event.kind in ("takeover", "execution", "fence"):
            return reverse("admin:django_outbox_fence_change", args=[data["task_id"]])
    except NoReverseMatch:
        return ""
    return ""
