"""The effect ledger on real PostgreSQL: rollback, conflicts, two concurrent executions."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections, transaction
from django.db.models import F

from celery_explicit import IdempotencyConflict
from django_outbox import ledger
from django_outbox.models import ProcessedOperation
from tests.testapp.models import Counter

pytestmark = pytest.mark.django_db(transaction=True)


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
                time.sleep(0.5)
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
    assert seen["waited"] >= 0.3  # it was blocked by the first transaction
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
