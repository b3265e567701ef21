"""The dead letters' list: open letters first, replay and discard behind their permissions.

A dead letter is evidence: read-only like every list, its page opens on "did the
effect happen?" (the ledger's answer). Replay and discard each show what they will do
to every selected letter (``admin.replay``) before they do it.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils.html import format_html

from django_outbox import times
from django_outbox.admin import job_page
from django_outbox.admin import replay as admin_replay
from django_outbox.admin.lists.cancellations import CancelJobs
from django_outbox.admin.lists.read_only import ReadOnlyAdmin
from django_outbox.models import DeadLetter, DeadLetterStatus, ProcessedOperation
from django_outbox.store import dead_letters

__all__ = ["DeadLetterAdmin", "DeadLetterStatusFilter"]


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
class DeadLetterAdmin(CancelJobs, ReadOnlyAdmin):
    cancel_by_key = True  # a replay is a new task id of the same key
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
    list_filter = (DeadLetterStatusFilter, "reason", "task_name", "app_version")
    search_fields = ("idempotency_key", "task_id")
    date_hierarchy = "last_attempt"
    actions = ("replay", "discard", "cancel_jobs")
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
            else "No: no ledger entry for its key."
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
