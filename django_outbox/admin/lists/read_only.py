"""The base of every list: rows written by workers are evidence, shown read-only.

``ReadOnlyAdmin`` refuses add, change and delete, and shows every time field as the
incident tools write a time (``times.shown``); ``short`` cuts a long id to one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import admin
from django.db import models
from django.http import HttpRequest
from django.utils.html import format_html

from django_outbox import times

__all__ = ["ReadOnlyAdmin", "short"]


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
