"""The ledger's statements as server-side prepared statements, on real PostgreSQL.

PostgreSQL keeps prepared statements per session; these tests read them back from
``pg_prepared_statements`` on the same connection the effects use.
"""

from __future__ import annotations

import logging

import pytest
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from celery_explicit.errors import LeaseLost
from django_outbox import ledger
from django_outbox.models import Fence, ProcessedOperation

pytestmark = pytest.mark.django_db(transaction=True)


def prepared_names() -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT name FROM pg_prepared_statements WHERE starts_with(name, 'explicit_')")
        return {name for (name,) in cursor.fetchall()}


def run_effect(key: str, *, task_id: str = "job", fence: int | None = None,
               ref: str = "") -> None:
    with ledger.effect(key=key, fingerprint="f", task_name="t", task_id=task_id,
                       fence=fence) as eff:
        assert not eff.done
        eff.result_ref = ref


@pytest.fixture(autouse=True)
def fresh_session():  # type: ignore[no-untyped-def]
    # A new server session: nothing prepared by an earlier test on this connection.
    connection.close()
    yield
    connection.close()


def test_each_statement_is_prepared_once_per_connection() -> None:
    run_effect("p1", fence=1, ref="r1")
    names = prepared_names()
    assert len(names) == 3  # the claim, the result_ref update, the fence check
    # Preparing one again would fail ("already exists"): these effects reuse them.
    for i in range(3):
        run_effect(f"p2-{i}", fence=1, ref="r")
    assert prepared_names() == names
    assert ProcessedOperation.objects.filter(key__startswith="p").count() == 4
    assert ProcessedOperation.objects.get(key="p1").result_ref == "r1"


def test_a_commit_refused_part_way_leaves_the_connection_usable() -> None:
    Fence.objects.create(task_id="taken", token=5, taken_over_at=timezone.now())
    # First use on this session: the PREPAREs run, then the fence check refuses the
    # commit. Which PREPAREs ran is read back before the next effect.
    with pytest.raises(LeaseLost):
        run_effect("q1", task_id="taken", fence=2, ref="r")
    assert not ProcessedOperation.objects.filter(key="q1").exists()
    run_effect("q2", task_id="other", fence=2, ref="r")
    run_effect("q3", task_id="other", fence=2, ref="r")
    assert set(ProcessedOperation.objects.values_list("key", flat=True)) == {"q2", "q3"}
    assert len(prepared_names()) == 3


def test_statements_the_server_lost_are_noticed_and_the_effect_commits(
        caplog: pytest.LogCaptureFixture) -> None:
    run_effect("d1", ref="r")
    assert prepared_names()
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")  # what a pooling proxy's new server session looks like
    with caplog.at_level(logging.WARNING, logger="django_outbox.ledger"):
        run_effect("d2", ref="r2")
        run_effect("d3", ref="r3")
    assert ProcessedOperation.objects.get(key="d2").result_ref == "r2"
    assert ProcessedOperation.objects.get(key="d3").result_ref == "r3"
    warnings = [r for r in caplog.records if "EXPLICIT_LEDGER_PREPARED" in r.getMessage()]
    assert len(warnings) == 1
    assert prepared_names() == set()  # unprepared on this connection from then on


@override_settings(EXPLICIT_LEDGER_PREPARED=False)
def test_turned_off_nothing_is_prepared() -> None:
    run_effect("n1", fence=1, ref="r")
    assert ProcessedOperation.objects.filter(key="n1").exists()
    assert prepared_names() == set()
