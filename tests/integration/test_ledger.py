"""The effect ledger on real PostgreSQL: rollback, conflicts, two concurrent executions."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import DatabaseError, connection, connections, transaction
from django.db.models import F
from django.db.transaction import TransactionManagementError
from django.test import override_settings

from celery_explicit import IdempotencyConflict
from django_outbox.db import ledger_sql
from django_outbox.models import ProcessedOperation
from django_outbox.store import ledger
from tests.testapp.models import Counter

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True, params=[True, False], ids=["round-trips", "plain-cursor"])
def round_trips(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Every ledger test runs on both paths: BEGIN+claim / writes+COMMIT sent together
    through libpq, and every statement through Django's cursor."""
    with override_settings(EXPLICIT_LEDGER_ROUND_TRIPS=request.param):
        yield request.param


def claim(key: str, fingerprint: str = "f1"):  # type: ignore[no-untyped-def]
    return ledger.effect(key=key, fingerprint=fingerprint, task_name="t", task_id="id")


def test_first_run_applies_and_stores_result_ref() -> None:
    with claim("k1") as eff:
        assert not eff.done
        eff.result_ref = "ref-1"
    row = ProcessedOperation.objects.get(key="k1")
    assert row.result_ref == "ref-1"
    with claim("k1") as again:
        assert again.done
        assert again.result_ref == "ref-1"


def test_rollback_leaves_no_ledger_row_and_no_effect() -> None:
    Counter.objects.create(name="rb")
    with pytest.raises(RuntimeError), claim("k2") as eff:
        assert not eff.done
        Counter.objects.filter(name="rb").update(value=F("value") + 1)
        raise RuntimeError("downstream failed mid-effect")
    assert not ProcessedOperation.objects.filter(key="k2").exists()
    assert Counter.objects.get(name="rb").value == 0
    with claim("k2") as eff:  # the retry applies
        assert not eff.done


def test_same_key_other_arguments_is_a_conflict() -> None:
    with claim("k3", "aaa"):
        pass
    with pytest.raises(IdempotencyConflict) as caught, claim("k3", "bbb"):
        pass
    assert caught.value.key == "k3"
    assert "already applied with different arguments" in str(caught.value)


def test_effect_inside_an_outer_transaction_rolls_back_with_it() -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        with claim("k4"):
            pass
        raise RuntimeError("outer rollback")
    assert not ProcessedOperation.objects.filter(key="k4").exists()


def test_concurrent_second_execution_waits_then_sees_done() -> None:
    """The second claimant blocks on the unique index until the first commits."""
    Counter.objects.create(name="cc")
    first_inside = threading.Event()
    seen: dict[str, object] = {}

    def first() -> None:
        try:
            with claim("k5") as eff:
                seen["first_done"] = eff.done
                first_inside.set()
                Counter.objects.filter(name="cc").update(value=F("value") + 1)
                time.sleep(2.0)  # the second thread connects and claims meanwhile
        finally:
            connections.close_all()

    def second() -> None:
        try:
            first_inside.wait(5)
            start = time.monotonic()
            with claim("k5") as eff:
                seen["second_done"] = eff.done
                seen["waited"] = time.monotonic() - start
                if not eff.done:
                    Counter.objects.filter(name="cc").update(value=F("value") + 1)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen["first_done"] is False
    assert seen["second_done"] is True
    assert seen["waited"] >= 1.0  # it was blocked by the first transaction
    assert Counter.objects.get(name="cc").value == 1
    connection.close()


def test_concurrent_second_execution_applies_when_first_rolls_back() -> None:
    first_inside = threading.Event()
    seen: dict[str, object] = {}

    def first() -> None:
        try:
            with claim("k6"):
                first_inside.set()
                time.sleep(0.3)
                raise RuntimeError("first fails")
        except RuntimeError:
            pass
        finally:
            connections.close_all()

    def second() -> None:
        try:
            first_inside.wait(5)
            with claim("k6") as eff:
                seen["second_done"] = eff.done
        finally:
            connections.close_all()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen["second_done"] is False
    assert ProcessedOperation.objects.filter(key="k6").count() == 1


def test_on_commit_hooks_run_after_the_effect_commits() -> None:
    ran: list[bool] = []
    with claim("k7"):
        transaction.on_commit(
            lambda: ran.append(ProcessedOperation.objects.filter(key="k7").exists())
        )
        assert ran == []
    assert ran == [True]  # ran once, and saw the committed row


def test_a_failing_last_write_rolls_back_effect_and_ledger_and_leaves_a_clean_connection() -> None:
    Counter.objects.create(name="lw")
    bad = [("INSERT INTO no_such_table VALUES (%s)", [1])]
    with (
        pytest.raises(DatabaseError),
        ledger.effect(
            key="k8", fingerprint="f", task_name="t", task_id="id", before_commit=lambda e: bad
        ),
    ):
        Counter.objects.filter(name="lw").update(value=F("value") + 1)
    assert not ProcessedOperation.objects.filter(key="k8").exists()
    assert Counter.objects.get(name="lw").value == 0
    assert connection.get_autocommit()
    with claim("k8") as eff:  # the connection is usable and the key still free
        assert not eff.done


def test_an_effect_marked_for_rollback_does_not_commit_and_says_so() -> None:
    Counter.objects.create(name="nr")
    with (
        pytest.raises(TransactionManagementError, match="rolled back: a database error inside"),
        ledger.effect(key="nr", fingerprint="f", task_name="t", task_id="i"),
    ):
        Counter.objects.filter(name="nr").update(value=1)
        transaction.set_rollback(True)  # what a caught error inside atomic() leaves behind
    assert Counter.objects.get(name="nr").value == 0
    assert not ProcessedOperation.objects.filter(key="nr").exists()


def test_before_commit_statements_commit_with_the_effect() -> None:
    from django.utils import timezone

    from django_outbox.models import Attempt, Outcome
    from django_outbox.store import attempts

    now = timezone.now()
    fields = attempts.attempt_fields(
        task_id="t9",
        task_name="t",
        idempotency_key="k9",
        attempt=1,
        redelivered=False,
        worker_host="h",
        worker_pid=1,
        started_at=now,
        finished_at=now,
        outcome=Outcome.APPLIED,
    )
    with ledger.effect(
        key="k9",
        fingerprint="f",
        task_name="t",
        task_id="t9",
        before_commit=lambda e: [attempts.insert_statement(fields)],
    ) as eff:
        eff.result_ref = "r9"
    row = Attempt.objects.get(task_id="t9")
    assert row.outcome == Outcome.APPLIED
    assert row.started_at == now
    assert ProcessedOperation.objects.get(key="k9").result_ref == "r9"


def test_a_row_deleted_between_the_lost_claim_and_the_read_is_claimed_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prune of old ledger rows can delete the row a claim lost to before the claim
    reads it: nothing holds the key any more, so the effect claims it again and runs."""
    with claim("k9", fingerprint="old") as eff:
        assert not eff.done
    table = ProcessedOperation._meta.db_table
    # The read deletes the row (as a prune between the two statements would have) and
    # reads nothing.
    monkeypatch.setattr(
        ledger_sql,
        "EXISTING",
        f"WITH pruned AS (DELETE FROM {table} WHERE key = %s) "
        f"SELECT fingerprint, result_ref FROM {table} WHERE false",
    )
    with claim("k9", fingerprint="new") as eff:
        assert not eff.done  # claimed again, not a conflict with the pruned row
        eff.result_ref = "second"
    row = ProcessedOperation.objects.get(key="k9")
    assert (row.fingerprint, row.result_ref) == ("new", "second")
    connection.close()


def renamed(key: str, others: list[str], fingerprint: str = "f1", accepted=()):  # type: ignore[no-untyped-def]
    return ledger.effect(
        key=key,
        fingerprint=fingerprint,
        task_name="t",
        task_id="id",
        other_keys=others,
        accepted_fingerprints=accepted,
    )


def test_an_effect_applied_under_another_name_is_done_and_its_result_carried() -> None:
    with claim("cap:1") as first:
        first.result_ref = "ref-cap"
    with renamed("payment:1:capture", ["cap:1"]) as again:
        assert again.done and again.result_ref == "ref-cap"
    # The key of record now holds the result too: its next duplicate is handed it.
    assert ProcessedOperation.objects.get(key="payment:1:capture").result_ref == "ref-cap"
    with claim("payment:1:capture") as third:
        assert third.done and third.result_ref == "ref-cap"


def test_an_effect_applied_now_is_recorded_under_every_name() -> None:
    with renamed("payment:2:capture", ["cap:2"]) as eff:
        assert not eff.done
        eff.result_ref = "ref-2"
    refs = dict(ProcessedOperation.objects.values_list("key", "result_ref"))
    assert refs == {"payment:2:capture": "ref-2", "cap:2": "ref-2"}
    # An older worker, which knows only the old name, finds it.
    with claim("cap:2") as old:
        assert old.done and old.result_ref == "ref-2"


def test_an_accepted_fingerprint_is_no_conflict_and_another_one_is() -> None:
    with claim("k-fp", fingerprint="legacy") as eff:
        assert not eff.done
    with renamed("k-fp", [], fingerprint="identity", accepted=["legacy"]) as again:
        assert again.done
    with pytest.raises(IdempotencyConflict), renamed("k-fp", [], fingerprint="other"):
        pass
