"""Beat schedulers that publish each periodic entry once per schedule slot.

Run beat with one of ours instead of Celery's::

    celery -A proj beat -S celery_explicit.beat:PersistentScheduler
    celery -A proj beat -S celery_explicit.beat_database:DatabaseScheduler  # django-celery-beat

Each due run is named by its slot and claimed in the state store before it is
published (``celery_explicit.periodic`` says what a slot is and how the claim works):

- this beat claimed it: the message is published with the slot in its headers
  (``explicit_slot``, ``explicit_periodic_entry``, ``explicit_published_via=beat``)
  and, for a task declaring ``periodic = True``, as its ``slot`` argument; the slot is
  recorded as published (``django_outbox``'s ``PeriodicSlot``), so a slot nobody
  published shows as a gap (``django_outbox.W016``);
- another beat had claimed it: nothing is published; an attempt row with outcome
  ``deduplicated`` says which beat published the slot as which job, with a log line and
  ``explicit_periodic_slots_total{outcome="duplicate"}``;
- the state store does not answer: the message is published anyway (a slot lost is
  worse than a slot sent twice, whose second effect its idempotency key stops), and
  counted ``unclaimed``;
- the publish fails: the claim is given back, so the other beat, or this one's next
  tick, publishes the slot.

Interval entries run on a grid: beat's own ``schedule(run_every)`` counts from when the
beat started, so two beats would run in two different slots; here each run falls on a
multiple of ``run_every`` since the epoch (``SlotClaims.reserve`` and ``is_due``).
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import sys
import uuid
from typing import Any

import celery.beat
from celery.beat import SchedulingError

from celery_explicit import job_log, keys, periodic, records, store
from celery_explicit.headers import PERIODIC_ENTRY_HEADER, PUBLISHED_VIA_HEADER, SLOT_HEADER
from celery_explicit.outcomes import Outcome

__all__ = ["PersistentScheduler", "SlotClaims"]

logger = job_log.get_logger("celery_explicit.beat")

#: How a beat's messages say they were published (``explicit_published_via``).
PUBLISHED_VIA_BEAT = "beat"


class SlotClaims:
    """Mixin for a ``celery.beat.Scheduler`` subclass: claims each due run's slot
    before it publishes it. Put it first: ``class S(SlotClaims, Scheduler)``."""

    app: Any
    schedule: Any
    _tasks_since_sync: int

    def setup_schedule(self) -> None:
        # Without the store a dropped run would leave no trace: refuse to start.
        store.get()
        super().setup_schedule()  # type: ignore[misc]

    # --- when an entry is due ----------------------------------------------------------

    def is_due(self, entry: Any) -> tuple[bool, float]:
        due, next_time = super().is_due(entry)  # type: ignore[misc]
        grid = periodic.grid_of(entry.schedule)
        if due and grid.kind == "interval":
            # Wake at the next multiple of run_every, not run_every from now: beat's
            # heap would otherwise drift later by its own latency on every run, until
            # a run lands a slot late and the slot between is never published.
            now = dt.datetime.now(dt.UTC)
            next_time = (grid.slot_at(now) - now).total_seconds() + grid.every
        return due, next_time

    def reserve(self, entry: Any) -> Any:
        now = dt.datetime.now(dt.UTC)
        grid = periodic.grid_of(entry.schedule)
        slot = grid.slot_at(now)
        new_entry = super().reserve(entry)  # type: ignore[misc]
        self._due_slots()[entry.name] = (slot, grid)
        if grid.kind == "interval":
            # The run counts from its slot's start, so the next is due at the next
            # multiple of run_every whichever beat runs it.
            _set_last_run_at(new_entry, slot)
        return new_entry

    def _due_slots(self) -> dict[str, tuple[dt.datetime, periodic.Grid]]:
        slots: dict[str, tuple[dt.datetime, periodic.Grid]] | None = self.__dict__.get(
            "_explicit_due_slots"
        )
        if slots is None:
            slots = self.__dict__["_explicit_due_slots"] = {}
        return slots

    # --- publishing --------------------------------------------------------------------

    def apply_async(
        self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        """Celery's ``Scheduler.apply_async``, with the slot claimed before the publish."""
        entry = self.reserve(entry) if advance else entry
        found = self._due_slots().pop(entry.name, None)
        if found is None:  # called without reserve() (a run forced by hand)
            grid = periodic.grid_of(entry.schedule)
            found = (grid.slot_at(dt.datetime.now(dt.UTC)), grid)
        slot_at, grid = found
        try:
            return self._publish_once(entry, producer, slot_at, grid)
        except Exception as exc:
            raise SchedulingError(
                f"Couldn't apply scheduled task {entry.name}: {exc}"
            ).with_traceback(sys.exc_info()[2]) from exc
        finally:
            self._tasks_since_sync += 1
            if self.should_sync():  # type: ignore[attr-defined]
                self._do_sync()  # type: ignore[attr-defined]

    def _publish_once(
        self, entry: Any, producer: Any, slot_at: dt.datetime, grid: periodic.Grid
    ) -> Any:
        import redis

        slot = periodic.format_slot(slot_at)
        task = self.app.tasks.get(entry.task)
        contract = getattr(type(task), "contract", None) if task is not None else None
        args = celery.beat._evaluate_entry_args(entry.args)  # type: ignore[attr-defined]
        entry_kwargs = celery.beat._evaluate_entry_kwargs(  # type: ignore[attr-defined]
            entry.kwargs
        )
        if contract is not None and contract.periodic:
            entry_kwargs = {**entry_kwargs, periodic.SLOT_PARAMETER: slot}
        key = _key_of(task, contract, args, entry_kwargs)
        options = dict(entry.options)
        headers = dict(options.pop("headers", None) or {})
        headers.update(
            {
                "celery_beat_task": True,  # as Celery's own scheduler marks its messages
                SLOT_HEADER: slot,
                PERIODIC_ENTRY_HEADER: entry.name,
                PUBLISHED_VIA_HEADER: PUBLISHED_VIA_BEAT,
            }
        )
        task_id = str(options.pop("task_id", None) or uuid.uuid4())
        host = f"{socket.gethostname()}:{os.getpid()}"
        log_fields = {
            "entry": entry.name,
            "slot": slot,
            "task": entry.task,
            "job_id": task_id,
            "idempotency_key": key,
            "layer": "delivery",
        }
        claimed: periodic.Claim | None = None
        try:
            claimed = periodic.claim(
                entry.name, slot, task_id, host, ttl=periodic.claim_ttl(grid.period(slot_at))
            )
        except redis.RedisError as exc:
            logger.warning(
                "periodic: state store unavailable (%s); slot published without a claim, "
                "its idempotency key still guards the effect",
                exc,
                extra=log_fields,
            )
            periodic.count(entry.task, "unclaimed")
        if claimed is not None and not claimed.won:
            _record_duplicate(entry, slot, task_id, key, host, claimed)
            return None
        try:
            if task is not None:
                result = task.apply_async(
                    args,
                    entry_kwargs,
                    producer=producer,
                    task_id=task_id,
                    headers=headers,
                    **options,
                )
            else:
                result = self.send_task(  # type: ignore[attr-defined]
                    entry.task,
                    args,
                    entry_kwargs,
                    producer=producer,
                    task_id=task_id,
                    headers=headers,
                    **options,
                )
        except BaseException:
            if claimed is not None:
                # Never published: the slot is still to be published, by whichever
                # beat comes next.
                periodic.release(claimed)
            raise
        if claimed is not None:
            periodic.count(entry.task, "published")
        store.get().record_slot(
            entry=entry.name,
            slot=slot_at,
            task_name=entry.task,
            task_id=task_id,
            idempotency_key=key,
            published_by=host,
            grid=grid.describe(),
        )
        logger.info("periodic: slot %s of %s published", slot, entry.name, extra=log_fields)
        return result


def _key_of(task: Any, contract: Any, args: Any, kwargs: dict[str, Any]) -> str:
    """The job's idempotency key, as its publish renders it ("" for another task, or
    arguments the publish will refuse with their own error)."""
    if contract is None:
        return ""
    try:
        _arguments, given = task.bind_arguments(tuple(args or ()), dict(kwargs))
        return keys.render_key(task.name, contract.idempotency_key, given)
    except Exception:  # BadInput, raised again by the publish itself
        return ""


def _record_duplicate(
    entry: Any, slot: str, task_id: str, key: str, host: str, claimed: periodic.Claim
) -> None:
    """A run this beat did not publish: its attempt row, its metric and its log line."""
    now = dt.datetime.now(dt.UTC)
    note = (
        f"slot {slot} of periodic entry {entry.name!r} was already published as job "
        f"{claimed.holder_task_id} by beat {claimed.holder_host}: this beat's run dropped"
    )
    periodic.count(entry.task, "duplicate")
    logger.info(
        "periodic: %s",
        note,
        extra={
            "entry": entry.name,
            "slot": slot,
            "task": entry.task,
            "job_id": task_id,
            "idempotency_key": key,
            "owner_job_id": claimed.holder_task_id,
            "layer": "delivery",
            "outcome": Outcome.DEDUPLICATED.value,
        },
    )
    store.get().record_attempt(
        records.attempt_fields(
            task_id=task_id,
            task_name=entry.task,
            idempotency_key=key,
            attempt=1,
            redelivered=False,
            worker_host=host.rsplit(":", 1)[0],
            worker_pid=os.getpid(),
            started_at=now,
            finished_at=now,
            outcome=Outcome.DEDUPLICATED,
            error_message=note,
            published_via=PUBLISHED_VIA_BEAT,
        ),
        replace=False,
    )


def _set_last_run_at(entry: Any, at: dt.datetime) -> None:
    """Move a just-reserved entry's last run to ``at``, in the same form as the
    scheduler keeps it (aware, or naive UTC), on django-celery-beat's row too."""
    current = entry.last_run_at
    if isinstance(current, dt.datetime) and current.tzinfo is None:
        value = at.astimezone(dt.UTC).replace(tzinfo=None)
    elif isinstance(current, dt.datetime):
        value = at.astimezone(current.tzinfo)
    else:
        value = at
    entry.last_run_at = value
    model = getattr(entry, "model", None)
    if model is not None:
        model.last_run_at = value


class PersistentScheduler(SlotClaims, celery.beat.PersistentScheduler):
    """Celery's default scheduler (entries from ``beat_schedule``, state in the
    schedule file), publishing each entry once per slot across beats."""
