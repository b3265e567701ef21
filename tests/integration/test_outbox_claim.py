"""``claim_batch`` on real PostgreSQL, and the relay command leaving
the project's Celery app as it found it."""

from __future__ import annotations

import contextlib
import io
import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.db.transaction import TransactionManagementError
from django.test import override_settings
from django.utils import timezone

from django_outbox.conf import settings
from django_outbox.db.relay_sql import BEYOND_LOOKAHEAD, SORT_OFF
from django_outbox.models import OutboxEvent
from django_outbox.outbox.events import publish_event
from django_outbox.outbox.relay.claim import (
    CLAIM_BEYOND_POSTGRESQL,
    CLAIM_POSTGRESQL,
    claim_batch,
)
from tests.support.queues import queued

pytestmark = pytest.mark.django_db(transaction=True)


def event(name: str, key: str = "", **fields: object) -> str:
    row = OutboxEvent.objects.create(
        task_name="tests.note", kwargs={"name": name}, ordering_key=key, **fields
    )
    return str(row.event_id)


def test_the_claim_takes_the_oldest_pending_event_of_each_key_in_order() -> None:
    a1, a2 = event("a1", "a"), event("a2", "a")
    loose = event("loose")
    b1 = event("b1", "b")
    event("later", available_at=timezone.now() + timedelta(hours=1))
    event("done", status="dead_letter")
    with transaction.atomic():
        claimed = claim_batch("default", 10)
    assert [c.event_id for c in claimed] == [a1, loose, b1]
    assert [c.kwargs for c in claimed] == [{"name": "a1"}, {"name": "loose"}, {"name": "b1"}]
    with transaction.atomic():
        assert [c.event_id for c in claim_batch("default", 2)] == [a1, loose]
    # a2 waits for a1 to leave the pending state, whoever holds it.
    OutboxEvent.objects.filter(event_id=a1).update(status="dead_letter")
    with transaction.atomic():
        assert [c.event_id for c in claim_batch("default", 10)] == [a2, loose, b1]


@contextlib.contextmanager
def held_claim(limit: int) -> Iterator[list[str]]:
    """A claim of ``limit`` events held in an open transaction on a connection of its
    own (another relay mid-batch); yields the event ids it took."""
    held = threading.Event()
    release = threading.Event()
    taken: list[str] = []

    def hold() -> None:
        try:
            with transaction.atomic():
                taken.extend(c.event_id for c in claim_batch("default", limit))
                held.set()
                release.wait(30)
        finally:
            connection.close()

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert held.wait(30)
        yield taken
    finally:
        release.set()
        thread.join(30)


def test_a_second_transaction_skips_the_rows_the_first_holds() -> None:
    first, second = event("first"), event("second")
    with held_claim(1) as taken:
        assert taken == [first]
        with transaction.atomic():
            # Not waiting for the lock, not returning the locked row: the next one.
            assert [c.event_id for c in claim_batch("default", 10)] == [second]


def backlog(successors: int) -> dict[str, str]:
    """Key h's oldest event; a's and b's first and an unkeyed one; h's ``successors``;
    c's first (behind them all), a's and b's second and one more unkeyed. The event id
    of each by name (h0, a1, loose1, b1, h1...)."""
    names = ["h0", "a1", "loose1", "b1"]
    names += [f"h{i}" for i in range(1, successors + 1)]
    names += ["c1", "a2", "b2", "loose2"]
    OutboxEvent.objects.bulk_create(
        OutboxEvent(
            task_name="tests.note",
            kwargs={"name": name},
            ordering_key="" if name.startswith("loose") else name[0],
        )
        for name in names
    )
    return {row.kwargs["name"]: str(row.event_id) for row in OutboxEvent.objects.all()}


@pytest.mark.parametrize("fast", [True, False], ids=["round-trips", "django-cursor"])
@pytest.mark.parametrize("successors", [3, 200], ids=["few-successors", "many-successors"])
def test_a_held_head_holds_back_its_own_key_and_nothing_else(successors: int, fast: bool) -> None:
    ids = backlog(successors)
    with held_claim(1) as taken:
        assert taken == [ids["h0"]]
        with override_settings(EXPLICIT_OUTBOX_RELAY_ROUND_TRIPS=fast), transaction.atomic():
            claimed = [c.event_id for c in claim_batch("default", 10)]
    # Every other key's oldest event and every unkeyed one, c's behind all of h's
    # successors included; none of h's: h0 is still pending, so h1 is not its head.
    assert claimed == [ids[name] for name in ("a1", "loose1", "b1", "c1", "loose2")]


def test_a_waiting_head_holds_back_its_key_beyond_the_look_ahead() -> None:
    ids = backlog(200)  # h's successors put what follows them beyond a batch of 10's
    waiting = event("d1", "d", available_at=timezone.now() + timedelta(hours=1))
    behind = event("d2", "d")
    with held_claim(1), transaction.atomic():
        claimed = [c.event_id for c in claim_batch("default", 10)]
    assert ids["c1"] in claimed
    assert waiting not in claimed
    assert behind not in claimed


def test_a_held_heads_successors_cost_the_claim_nothing() -> None:
    claims = (CLAIM_POSTGRESQL, BEYOND_LOOKAHEAD, CLAIM_BEYOND_POSTGRESQL)
    # Negative control: the same claims looking ahead past every successor read them.
    control_claims = tuple(sql.replace("4 * %(", "1000 * %(") for sql in claims)
    assert [sql.count("1000 *") for sql in control_claims] == [2, 1, 2]
    reads, control = {}, {}
    for successors in (1000, 4000):
        with connection.cursor() as cursor:  # no dead index entries of the first backlog
            cursor.execute(f"TRUNCATE {OutboxEvent._meta.db_table}")
        backlog(successors)
        with held_claim(1):
            reads[successors] = claim_reads(*claims, limit=10)
            control[successors] = claim_reads(*control_claims, limit=10)
    # The same rows read behind 1,000 successors as behind 4,000, fewer than either, and
    # the same buffers give or take where page boundaries fall: the claim does not
    # visit them.
    assert reads[1000]["rows"] == reads[4000]["rows"] < 1000, reads
    assert abs(reads[4000]["buffers"] - reads[1000]["buffers"]) <= 5, reads
    assert control[4000]["rows"] > control[1000]["rows"] > 1000, control


def claim_reads(near: str, gate: str, beyond: str, *, limit: int) -> dict[str, int]:
    """What a claim read, as run_claim() runs its statements: rows its scans returned or
    filtered out (index entries for an index-only scan), summed over their loops, and
    the shared buffers it touched; from EXPLAIN ANALYZE, in a transaction rolled back."""
    total = {"rows": 0, "buffers": 0}

    def explain(sql: str, params: dict[str, int]) -> None:
        cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}", params)
        (explained,) = cursor.fetchone()
        plan = (json.loads(explained) if isinstance(explained, str) else explained)[0]["Plan"]
        total["rows"] += _rows_read(plan)
        total["buffers"] += plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]

    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(SORT_OFF)
        # The claim itself first, for the rows the second statement starts after.
        cursor.execute(near, {"limit": limit})
        ids = [row[0] for row in cursor.fetchall()]
        explain(near, {"limit": limit})
        explain(gate, {"limit": limit})
        cursor.execute(gate, {"limit": limit})
        if len(ids) < limit and cursor.fetchone()[0]:
            params = {"limit": limit - len(ids), "batch": limit, "after": max(ids, default=0)}
            explain(beyond, params)
        transaction.set_rollback(True)
    return total


def _rows_read(node: dict[str, Any]) -> int:
    rows = 0
    if "Relation Name" in node or node["Node Type"] == "CTE Scan":
        per_loop = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
        rows += round(per_loop * node["Actual Loops"])
    return rows + sum(_rows_read(child) for child in node.get("Plans", []))


def test_the_claim_outside_a_transaction_is_refused() -> None:
    event("alone")
    with pytest.raises(TransactionManagementError, match=r"transaction\.atomic"):
        claim_batch("default", 10)


def test_the_relay_command_leaves_the_celery_app_settings_alone(queue, redis_client) -> None:
    app = settings.celery_app()
    app.finalize(auto=True)  # what the command does before publishing, Celery's own
    before = dict(app.conf.changes)
    with transaction.atomic():
        event_id = publish_event("tests.note", {"name": "conf"}, options={"queue": queue})
    call_command("explicit_relay", "--once", stdout=io.StringIO())
    assert [m["id"] for m in queued(redis_client, queue)] == [event_id]
    assert dict(app.conf.changes) == before
