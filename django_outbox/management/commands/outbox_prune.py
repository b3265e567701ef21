"""``manage.py outbox_prune --older-than 7d``: delete outbox events the relay is done with.

Published events are evidence for a while (which event became which task id, when);
after the retention they are only weight on the table. Deleted in batches, each in
its own short transaction, so a large purge never holds long locks or one huge
transaction. Pending events are never deleted.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from django_outbox.conf import settings
from django_outbox.management.arguments import positive_int
from django_outbox.models import OutboxEvent, OutboxStatus

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
    """Delete finished events older than ``older_than``; returns how many.

    Published events count from their publish; dead-lettered and deduplicated ones,
    which were never published, from their creation (the dead letter keeps the
    evidence of the former).
    """
    alias = using or settings.database
    cutoff = timezone.now() - older_than
    finished = OutboxEvent.objects.using(alias).filter(
        Q(status=OutboxStatus.PUBLISHED, published_at__lt=cutoff)
        | Q(
            status__in=[OutboxStatus.DEAD_LETTER, OutboxStatus.DEDUPLICATED],
            created_at__lt=cutoff,
        )
    )
    deleted = 0
    while True:
        with transaction.atomic(using=alias):
            ids = list(finished.order_by("id").values_list("id", flat=True)[:batch_size])
            if not ids:
                return deleted
            deleted += OutboxEvent.objects.using(alias).filter(id__in=ids).delete()[0]


class Command(BaseCommand):
    help = (
        "Delete outbox events published (or dead-lettered) longer ago than --older-than, "
        "in batches. Pending events are never deleted."
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
