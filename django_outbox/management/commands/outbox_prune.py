"""``manage.py outbox_prune --older-than 7d``: ``explicit_prune --table outbox`` with the
retention given on the command line instead of ``EXPLICIT_RETAIN_OUTBOX``.

Kept as an alias onto the same code (``django_outbox.retention``), not deprecated: the
cron lines that run it go on working, and since it is the same code they now also keep
the events reconciliation may still republish. Pending events are never deleted.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_outbox import retention
from django_outbox.management.arguments import positive_int

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")


def parse_duration(text: str) -> timedelta:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"90s"``, ``"2w"``; a bare number is days."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(
            f"cannot read {text!r} as a duration: use a number with s, m, h, d or w "
            "(a bare number is days), e.g. 7d"
        )
    number, unit = match.groups()
    return timedelta(seconds=float(number) * _UNITS[unit or "d"])


def prune(older_than: timedelta, *, batch_size: int = 1000, using: str | None = None) -> int:
    """Delete the outbox events ``explicit_prune --table outbox`` would, with
    ``older_than`` as the retention; returns how many."""
    return retention.prune(
        "outbox", using=using, seconds=older_than.total_seconds(), batch_size=batch_size
    )


class Command(BaseCommand):
    help = (
        "Delete outbox events published (or dead-lettered) longer ago than --older-than, "
        "in batches: explicit_prune --table outbox with its own retention. Pending events "
        "and events reconciliation may still republish are never deleted."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than",
            required=True,
            help="retention: 7d, 12h, 30m, 90s, 2w; a bare number is days",
        )
        parser.add_argument(
            "--batch-size", type=positive_int, default=1000, help="rows per delete (default 1000)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            older_than = parse_duration(options["older_than"])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        deleted = prune(older_than, batch_size=options["batch_size"])
        self.stdout.write(f"deleted {deleted} outbox events finished more than {older_than} ago")
