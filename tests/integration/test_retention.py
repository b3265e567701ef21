"""``manage.py explicit_prune`` (``django_outbox.retention``): what it deletes, what it
never deletes, the ledger's floor, and its checks. Real PostgreSQL; a real worker where
prune runs beside jobs."""

from __future__ import annotations

import dataclasses
import math
import threading
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError, SystemCheckError
from django.utils import timezone

from celery_explicit.dedup import Dedup
from django_outbox import retention
from django_outbox.conf import settings as explicit_settings
from django_outbox.models import (
    Attempt,
    Cancellation,
    DeadLetter,
    DeadLetterReason,
    DeadLetterStatus,
    Fence,
    OutboxEvent,
    OutboxStatus,
    Outcome,
    ProcessedOperation,
    PruneRecord,
)
from tests.support.waiting import wait_for
from tests.testapp.models import Counter
from tests.testapp.tasks import Increment

DAY = 86400.0


# --- rows of each table, at a given age ---------------------------------------------------


def ago(seconds: float) -> datetime:
    return timezone.now() - timedelta(seconds=seconds)


def attempt(started: datetime, outcome: str = Outcome.APPLIED) -> int:
    # Another task's name: the worker test counts the attempts its jobs write.
    row = Attempt.objects.create(
        task_id=uuid.uuid4().hex,
        task_name="tests.seeded",
        attempt=1,
        started_at=started,
        finished_at=started,
        duration_ms=1.0,
        outcome=outcome,
    )
    return row.pk


def cancellation(requested: datetime) -> int:
    row = Cancellation.objects.create(
        idempotency_key=f"ship:{uuid.uuid4().hex[:8]}", requested_by="alice", requested_at=requested
    )
    return row.pk


def fence(taken_over: datetime) -> str:
    return Fence.objects.create(task_id=uuid.uuid4().hex, token=2, taken_over_at=taken_over).task_id


def dead_letter(status: str, *, seen: datetime, resolved: datetime | None = None) -> int:
    row = DeadLetter.objects.create(
        task_id=uuid.uuid4().hex,
        task_name="tests.increment",
        reason=DeadLetterReason.PERMANENT,
        first_seen=seen,
        last_attempt=seen,
        status=status,
        resolved_at=resolved,
    )
    return row.pk


def event(
    status: str, *, created: datetime, published: datetime | None = None, checked: bool = False
) -> int:
    row = OutboxEvent.objects.create(
        task_name="tests.increment",
        status=status,
        published_at=published,
        checked_at=published if checked else None,
    )
    OutboxEvent.objects.filter(pk=row.pk).update(created_at=created)
    return row.pk


def ledger(processed: datetime) -> str:
    return ProcessedOperation.objects.create(
        key=f"k:{uuid.uuid4().hex}",
        task_name="tests.increment",
        task_id=uuid.uuid4().hex,
        fingerprint="0" * 64,
        processed_at=processed,
    ).key


def keys(model: Any) -> set[Any]:
    return set(model.objects.values_list("pk", flat=True))


def prune(*args: str) -> str:
    out = StringIO()
    call_command("explicit_prune", *args, stdout=out)
    return out.getvalue()


# --- what is deleted, and what is kept ------------------------------------------------------


@pytest.mark.django_db
def test_prune_deletes_old_rows_of_each_table_and_keeps_recent_ones() -> None:
    # The defaults: attempts and fences 30 d, resolved dead letters 90 d, outbox 7 d,
    # ledger 30 d (above the test configuration's floor of about a day).
    old = [attempt(ago(31 * DAY), outcome) for outcome in Outcome.values]
    young = {attempt(ago(29 * DAY)), attempt(ago(60))}
    old_fence, young_fence = fence(ago(31 * DAY)), fence(ago(DAY))
    old_letter = dead_letter(
        DeadLetterStatus.DISCARDED, seen=ago(100 * DAY), resolved=ago(91 * DAY)
    )
    replayed = dead_letter(DeadLetterStatus.REPLAYED, seen=ago(100 * DAY), resolved=ago(91 * DAY))
    young_letter = dead_letter(
        DeadLetterStatus.REPLAYED, seen=ago(100 * DAY), resolved=ago(89 * DAY)
    )
    old_events = {
        event(OutboxStatus.PUBLISHED, created=ago(8 * DAY), published=ago(8 * DAY), checked=True),
        event(OutboxStatus.DEAD_LETTER, created=ago(8 * DAY)),
        event(OutboxStatus.DEDUPLICATED, created=ago(8 * DAY)),
    }
    young_event = event(
        OutboxStatus.PUBLISHED, created=ago(6 * DAY), published=ago(6 * DAY), checked=True
    )
    old_key, young_key = ledger(ago(31 * DAY)), ledger(ago(29 * DAY))
    old_cancel, young_cancel = cancellation(ago(91 * DAY)), cancellation(ago(89 * DAY))

    out = prune("--batch-size", "2")

    assert keys(Attempt) == young
    assert keys(Fence) == {young_fence}
    assert keys(DeadLetter) == {young_letter}
    assert keys(OutboxEvent) == {young_event}
    assert keys(ProcessedOperation) == {young_key}
    assert keys(Cancellation) == {young_cancel} and old_cancel != young_cancel
    assert not {old_fence, old_letter, replayed, old_key} & (
        keys(Fence) | keys(DeadLetter) | keys(ProcessedOperation)
    )
    assert not old_events & keys(OutboxEvent)
    for line in (
        f"attempts: deleted {len(old)} rows older than 30d (EXPLICIT_RETAIN_ATTEMPTS)",
        "fences: deleted 1 rows",
        "dead_letters: deleted 2 rows older than 90d",
        "outbox: deleted 3 rows older than 7d",
        "ledger: deleted 1 rows older than 30d (EXPLICIT_RETAIN_LEDGER)",
        "cancellations: deleted 1 rows older than 90d (EXPLICIT_RETAIN_CANCELLATIONS)",
    ):
        assert line in out
    assert dict(PruneRecord.objects.values_list("table", "deleted")) == {
        "attempts": len(old),
        "fences": 1,
        "dead_letters": 2,
        "outbox": 3,
        "ledger": 1,
        "cancellations": 1,
    }


@pytest.mark.django_db
def test_prune_never_deletes_open_letters_unreconciled_events_or_ledger_inside_the_floor(
    settings: Any,
) -> None:
    floor = retention.ledger_floor().seconds
    settings.EXPLICIT_RETAIN_DEAD_LETTERS = 60.0
    settings.EXPLICIT_RETAIN_OUTBOX = 60.0
    settings.EXPLICIT_RETAIN_LEDGER = floor  # as short as it may be
    horizon = explicit_settings.outbox_reconcile_horizon

    open_letter = dead_letter(DeadLetterStatus.OPEN, seen=ago(365 * DAY))
    discarded = dead_letter(DeadLetterStatus.DISCARDED, seen=ago(DAY), resolved=ago(3600))
    # Published an hour ago, past the retention: the reconciler has not found a trace
    # yet (no checked_at) and may still publish it again.
    unreconciled = event(OutboxStatus.PUBLISHED, created=ago(3600), published=ago(3600))
    pending = event(OutboxStatus.PENDING, created=ago(30 * DAY))
    reconciled = event(OutboxStatus.PUBLISHED, created=ago(3600), published=ago(3600), checked=True)
    # Past the horizon: the reconciler never looks at it again (it only marks it).
    aged_out = event(
        OutboxStatus.PUBLISHED, created=ago(horizon + 3600), published=ago(horizon + 3600)
    )
    inside = ledger(ago(floor - 120))
    outside = ledger(ago(floor + 120))

    prune()

    assert keys(DeadLetter) == {open_letter}
    assert discarded not in keys(DeadLetter)
    assert keys(OutboxEvent) == {unreconciled, pending}
    assert not {reconciled, aged_out} & keys(OutboxEvent)
    assert keys(ProcessedOperation) == {inside}
    assert outside not in keys(ProcessedOperation)


@pytest.mark.django_db
def test_with_reconciliation_off_a_published_event_is_pruned_by_its_age(settings: Any) -> None:
    settings.EXPLICIT_OUTBOX_RECONCILE_AFTER = 0
    settings.EXPLICIT_RETAIN_OUTBOX = 60.0
    unchecked = event(OutboxStatus.PUBLISHED, created=ago(3600), published=ago(3600))
    prune("--table", "outbox")
    assert unchecked not in keys(OutboxEvent)


@pytest.mark.django_db
def test_older_than_prunes_the_named_table_with_its_own_retention() -> None:
    unreconciled = event(OutboxStatus.PUBLISHED, created=ago(2 * DAY), published=ago(3 * 3600))
    reconciled = event(
        OutboxStatus.PUBLISHED, created=ago(2 * DAY), published=ago(3 * 3600), checked=True
    )
    call_command("explicit_prune", "--table", "outbox", "--older-than", "1h", stdout=StringIO())
    assert keys(OutboxEvent) == {unreconciled}
    assert reconciled not in keys(OutboxEvent)
    assert PruneRecord.objects.get(table="outbox").deleted == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--older-than", "7d"], "--older-than needs --table"),
        (["--table", "outbox", "--older-than", "soon"], "cannot read 'soon' as a duration"),
        (["--table", "ledger", "--older-than", "1h"], "refuses to prune the ledger"),
    ],
)
def test_older_than_asked_wrongly_is_refused_before_anything_is_deleted(
    argv: list[str], error: str
) -> None:
    old = ledger(ago(31 * DAY))
    with pytest.raises(CommandError, match=error):
        call_command("explicit_prune", *argv, stdout=StringIO())
    assert old in keys(ProcessedOperation)


@pytest.mark.django_db
def test_dry_run_counts_per_table_and_deletes_nothing() -> None:
    for _ in range(3):
        attempt(ago(31 * DAY))
    ledger(ago(31 * DAY))
    event(OutboxStatus.DEAD_LETTER, created=ago(8 * DAY))
    before = {model: keys(model) for model in (Attempt, ProcessedOperation, OutboxEvent)}

    out = prune("--dry-run")

    assert {model: keys(model) for model in before} == before
    assert "attempts: would delete 3 rows older than 30d" in out
    assert "fences: would delete 0 rows" in out
    assert "dead_letters: would delete 0 rows" in out
    assert "outbox: would delete 1 rows" in out
    assert "ledger: would delete 1 rows" in out
    assert not PruneRecord.objects.exists()


@pytest.mark.django_db
def test_table_picks_the_tables_pruned() -> None:
    old_attempt, old_key = attempt(ago(31 * DAY)), ledger(ago(31 * DAY))
    out = prune("--table", "attempts", "--table", "fences")
    assert old_attempt not in keys(Attempt)
    assert old_key in keys(ProcessedOperation)
    assert "ledger" not in out and "attempts: deleted 1 rows" in out


# --- the ledger's floor ------------------------------------------------------------------


def test_the_floor_adds_up_what_the_configuration_allows(settings: Any) -> None:
    floor = retention.ledger_floor()
    described = floor.describe()
    # tests.settings: a 60 s backstop swept every 1 s, the 1 d horizon, the 30 s cap.
    assert "the Redis broker's visibility_timeout (60s) and restore sweep (1s)" in described
    assert "EXPLICIT_OUTBOX_RECONCILE_HORIZON (1d)" in described
    assert "EXPLICIT_DATABASE_OUTAGE_BACKOFF_CAP (30s)" in described
    assert "the retry schedule of task" in described
    assert floor.seconds == sum(term.seconds for term in floor.terms)
    assert floor.seconds > DAY + 61 + 30

    settings.EXPLICIT_OUTBOX_RECONCILE_AFTER = 0  # no reconciliation: no horizon
    assert retention.ledger_floor().seconds == pytest.approx(floor.seconds - DAY)


def test_a_dedup_window_longer_than_the_chain_sets_the_floor(settings: Any) -> None:
    from tests.celery_app import app

    settings.EXPLICIT_OUTBOX_RECONCILE_AFTER = 0
    recorder: Any = app.tasks["tests.record_event"]  # dedup_window = 30 s
    chain = retention.ledger_floor(app, [recorder])
    assert chain.seconds > 30

    class WideDedup:
        name = "tests.wide_dedup"
        contract = dataclasses.replace(
            recorder.contract, dedup=Dedup(key="{event_id}", window=chain.seconds + 100)
        )

    floor = retention.ledger_floor(app, [recorder, WideDedup()])
    assert floor.seconds == chain.seconds + 100
    assert floor.describe().startswith("dedup_window of task tests.wide_dedup")


def test_the_retry_schedule_is_the_backoff_ceilings_and_the_runs() -> None:
    contract = Increment.contract  # 5 attempts, base 1 s, cap 60 s, lease 30 s
    assert retention.retry_schedule(contract) == (1 + 2 + 4 + 8) + 4 * 30


@pytest.mark.django_db
def test_ledger_retention_below_the_floor_is_refused_and_nothing_is_deleted(
    settings: Any,
) -> None:
    settings.EXPLICIT_RETAIN_LEDGER = 3600.0
    settings.EXPLICIT_RETAIN_ATTEMPTS = 60.0
    old_attempt, old_key = attempt(ago(3 * 3600)), ledger(ago(2 * 3600))
    floor = retention.ledger_floor().seconds

    with pytest.raises(CommandError) as refused:
        prune()

    message = str(refused.value)
    assert "EXPLICIT_RETAIN_LEDGER=3600s (1h)" in message
    assert f"floor of {floor:g}s" in message
    assert "EXPLICIT_OUTBOX_RECONCILE_HORIZON" in message
    assert old_attempt in keys(Attempt) and old_key in keys(ProcessedOperation)
    with pytest.raises(retention.LedgerBelowFloor):
        retention.prune("ledger")
    assert old_key in keys(ProcessedOperation)
    # The other tables are not held hostage by the ledger's setting.
    prune("--table", "attempts")
    assert old_attempt not in keys(Attempt)


# --- checks ----------------------------------------------------------------------------------


def test_check_reports_a_ledger_retention_below_the_floor(settings: Any) -> None:
    assert retention.check_retention() == []
    settings.EXPLICIT_RETAIN_LEDGER = 3600.0
    found = retention.check_retention()
    assert [m.id for m in found] == ["django_outbox.E020"]
    assert "EXPLICIT_RETAIN_LEDGER=3600s" in found[0].msg
    assert "EXPLICIT_OUTBOX_RECONCILE_HORIZON" in found[0].msg
    floor = retention.ledger_floor().seconds
    assert f"at least {math.ceil(floor)}" in str(found[0].hint)
    with pytest.raises(SystemCheckError, match=r"django_outbox\.E020"):
        call_command("check")


def test_check_warns_when_attempts_are_kept_shorter_than_the_reconcile_horizon(
    settings: Any,
) -> None:
    settings.EXPLICIT_RETAIN_ATTEMPTS = 3600.0
    found = retention.check_retention()
    assert [m.id for m in found] == ["django_outbox.W021"]
    assert "EXPLICIT_RETAIN_ATTEMPTS=3600s" in found[0].msg


@pytest.mark.django_db
def test_check_warns_when_nothing_has_pruned_rows_past_their_retention() -> None:
    def pruned_check() -> list[Any]:
        return retention.check_pruned(databases=["default"])

    assert pruned_check() == []  # nothing past its retention: nothing to say
    attempt(ago(31 * DAY))
    found = pruned_check()
    assert [m.id for m in found] == ["django_outbox.W020"]
    assert "rows of attempts are past their retention" in found[0].msg
    assert "nothing has ever pruned them" in found[0].msg
    assert retention.check_pruned() == []  # without --database the check reads nothing

    PruneRecord.objects.create(table="attempts", pruned_at=ago(8 * DAY))  # > 7 d, outbox's
    assert [m.id for m in pruned_check()] == ["django_outbox.W020"]
    prune("--table", "attempts")
    assert pruned_check() == []


# --- beside a worker under load --------------------------------------------------------------


@pytest.mark.worker
@pytest.mark.parametrize("pruning", [True, False], ids=["prune", "negative-control"])
def test_prune_beside_a_worker_loses_nothing_it_must_keep(
    start_worker: Callable[..., Any], queue: str, settings: Any, pruning: bool
) -> None:
    """Jobs run on a real worker (writing attempts and ledger rows) while the prune runs
    again and again in small batches. Afterwards every open dead letter, unreconciled
    event and ledger row inside the floor is still there, and every job's effect was
    applied once; the rows past their retention are gone. The control, without the
    prune, shows they are gone because of it."""
    floor = retention.ledger_floor().seconds
    settings.EXPLICIT_RETAIN_LEDGER = floor
    settings.EXPLICIT_RETAIN_ATTEMPTS = DAY
    settings.EXPLICIT_RETAIN_DEAD_LETTERS = 60.0
    settings.EXPLICIT_RETAIN_OUTBOX = 60.0
    keep_letters = {dead_letter(DeadLetterStatus.OPEN, seen=ago(i * DAY)) for i in range(1, 40)}
    keep_events = {
        event(OutboxStatus.PUBLISHED, created=ago(i * 60), published=ago(i * 60))
        for i in range(2, 60)
    }
    keep_ledger = {ledger(ago(floor - 60 - i)) for i in range(60)}
    due_attempts = {attempt(ago(2 * DAY + i)) for i in range(300)}
    due_ledger = {ledger(ago(floor + 60 + i)) for i in range(300)}
    due_letters = {
        dead_letter(DeadLetterStatus.DISCARDED, seen=ago(DAY), resolved=ago(3600 + i))
        for i in range(40)
    }

    jobs = 120
    Counter.objects.create(name="prune", value=0)
    start_worker(concurrency=2)
    for i in range(jobs):
        Increment().apply_async(kwargs={"name": "prune", "op_id": str(i)}, queue=queue)

    runs = 0
    stop = threading.Event()
    errors: list[BaseException] = []

    def prune_in_a_loop() -> None:
        nonlocal runs
        from django.db import connection

        try:
            while not stop.is_set():
                prune("--batch-size", "7")
                runs += 1
        except BaseException as exc:  # reported by the test below
            errors.append(exc)
        finally:
            connection.close()

    pruner = threading.Thread(target=prune_in_a_loop) if pruning else None
    if pruner is not None:
        pruner.start()
    try:
        wait_for(
            lambda: (
                Attempt.objects.filter(task_name=Increment.name, outcome="applied").count() == jobs
            ),
            timeout=90,
            what=f"{jobs} jobs applied",
        )
    finally:
        stop.set()
        if pruner is not None:
            pruner.join(60)
    assert errors == []

    assert Counter.objects.get(name="prune").value == jobs
    job_keys = {f"counter:prune:op:{i}" for i in range(jobs)}
    assert job_keys <= keys(ProcessedOperation)
    assert keep_letters <= keys(DeadLetter)
    assert keep_events <= keys(OutboxEvent)
    assert keep_ledger <= keys(ProcessedOperation)
    if pruning:
        assert runs >= 1
        assert not due_attempts & keys(Attempt)
        assert not due_ledger & keys(ProcessedOperation)
        assert not due_letters & keys(DeadLetter)
    else:
        assert due_attempts <= keys(Attempt)
        assert due_ledger <= keys(ProcessedOperation)
        assert due_letters <= keys(DeadLetter)
