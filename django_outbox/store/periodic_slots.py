"""The slots beats published of periodic entries, and the ones nobody published.

A beat running our scheduler (``celery_explicit.beat``) writes one row per slot it
published (``record``), after the claim and the publish. ``missing`` compares them with
the slots the entry's schedule says were due: a gap is a slot no beat published (every
beat was down, or stopped, across it), which Celery's beat never reports. A slot a
second beat dropped is not here: it is an attempt with outcome ``deduplicated``.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterable
from dataclasses import dataclass

from django.db import DatabaseError
from django.utils import timezone

from celery_explicit import job_log
from celery_explicit.periodic import Grid
from django_outbox.conf import settings
from django_outbox.models import PeriodicSlot

__all__ = ["KEEP", "Gap", "for_tasks", "missing", "record"]

logger = job_log.get_logger("django_outbox.store.periodic_slots")

#: How long a published slot is kept (seconds): the window the gap check looks at, and
#: more. Older rows of an entry are removed as its new ones are written.
KEEP = 7 * 86400.0
#: Seconds between two prunes of one entry's old rows by one beat: a prune per publish
#: was two of the publish's three transactions (bench/periodic_cost.py).
PRUNE_EVERY = 3600.0

#: When this process last pruned each entry's rows (``time.monotonic()``).
_pruned_at: dict[str, float] = {}


def record(
    *,
    entry: str,
    slot: dt.datetime,
    task_name: str,
    task_id: str,
    idempotency_key: str,
    published_by: str,
    grid: str,
) -> None:
    """One published slot; a failure is logged with the row, never raised (the message
    is on the broker already, and the log line keeps the evidence)."""
    db = settings.database
    now = timezone.now()
    try:
        PeriodicSlot.objects.using(db).bulk_create(
            [
                PeriodicSlot(
                    entry=entry[:200],
                    slot=slot,
                    task_name=task_name[:255],
                    task_id=task_id[:255],
                    idempotency_key=idempotency_key[:255],
                    published_at=now,
                    published_by=published_by[:255],
                    grid=grid[:255],
                )
            ],
            ignore_conflicts=True,  # a slot published again after its claim expired
        )
        last = _pruned_at.get(entry)
        if last is None or time.monotonic() - last >= PRUNE_EVERY:
            PeriodicSlot.objects.using(db).filter(
                entry=entry[:200], slot__lt=now - dt.timedelta(seconds=KEEP)
            ).delete()
            _pruned_at[entry] = time.monotonic()
    except DatabaseError:
        logger.exception(
            "periodic: could not record the published slot",
            extra={
                "entry": entry,
                "slot": slot.isoformat(),
                "task": task_name,
                "job_id": task_id,
                "idempotency_key": idempotency_key,
            },
        )


@dataclass(frozen=True)
class Gap:
    """The slots of one entry nobody published, in the window looked at."""

    entry: str
    task_name: str
    grid: str
    slots: list[dt.datetime]
    #: The last slot that was published (None: none in the window).
    last_published: dt.datetime | None


def missing(
    *,
    now: dt.datetime | None = None,
    window: float = 86400.0,
    grace: float = 120.0,
    limit: int = 100_000,
) -> list[Gap]:
    """Each entry with a slot due in the last ``window`` seconds (from its first slot
    published in the window, until ``grace`` seconds ago: a beat publishes a little
    after the slot) that no beat published. An entry is judged by the grid its latest
    row recorded; ``limit`` bounds the slots computed per entry."""
    db = settings.database
    now = now or timezone.now()
    since = now - dt.timedelta(seconds=window)
    until = now - dt.timedelta(seconds=grace)
    rows = (
        PeriodicSlot.objects.using(db)
        .filter(slot__gte=since)
        .order_by("entry", "slot")
        .values_list("entry", "slot", "task_name", "grid")
    )
    by_entry: dict[str, list[tuple[dt.datetime, str, str]]] = {}
    for entry, slot, task_name, described in rows.iterator(chunk_size=5000):
        by_entry.setdefault(entry, []).append((slot, task_name, described))
    gaps = []
    for entry, published in sorted(by_entry.items()):
        first = published[0][0]
        last, task_name, recorded_grid = published[-1]
        grid = Grid.parse(recorded_grid)
        seen = {slot for slot, _task, _grid in published}
        absent = list(_absent(grid.slots_between(first, until), seen, limit))
        if absent:
            gaps.append(
                Gap(
                    entry=entry,
                    task_name=task_name,
                    grid=grid.describe(),
                    slots=absent,
                    last_published=last,
                )
            )
    return gaps


def _absent(
    expected: Iterable[dt.datetime], seen: set[dt.datetime], limit: int
) -> Iterable[dt.datetime]:
    for count, slot in enumerate(expected):
        if count >= limit:
            return
        if slot not in seen:
            yield slot


def for_tasks(task_ids: Iterable[str]) -> list[PeriodicSlot]:
    """The slots these jobs were published for (``explain``)."""
    ids = [t for t in task_ids if t]
    if not ids:
        return []
    return list(PeriodicSlot.objects.using(settings.database).filter(task_id__in=ids))
