"""dispatch(): published after commit, never for a rollback; bad input fails at the call.

Real PostgreSQL transactions (``transaction=True``: on_commit runs only on a real
commit) and the real Redis broker: each test reads its own queue.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.db import transaction
from django.db.transaction import TransactionManagementError
from kombu import Connection
from prometheus_client import REGISTRY

from celery_explicit import BadInput
from django_outbox.models import OutboxEvent, OutboxStatus
from django_outbox.outbox.dispatch import dispatch
from django_outbox.outbox.events import publish_event
from tests.support.ports import free_port
from tests.support.queues import queued
from tests.testapp.models import Counter
from tests.testapp.tasks import Increment, increment_unguarded

pytestmark = pytest.mark.django_db(transaction=True)


class BusinessError(Exception):
    pass


def test_rollback_publishes_nothing_and_writes_no_outbox_row(queue, redis_client) -> None:
    with pytest.raises(BusinessError), transaction.atomic():
        Counter.objects.create(name="rolled-back")
        dispatch(
            Increment(), kwargs={"name": "rolled-back", "op_id": "1"}, options={"queue": queue}
        )
        dispatch(Increment(), kwargs={"name": "rolled-back", "op_id": "2"}, durable=True)
        publish_event("tests.note", {"name": "rolled-back"})
        raise BusinessError("the order could not be saved")
    assert redis_client.llen(queue) == 0
    assert not OutboxEvent.objects.exists()
    assert not Counter.objects.exists()


def test_commit_publishes_after_the_commit_not_before(queue, redis_client) -> None:
    with transaction.atomic():
        task_id = dispatch(
            Increment(), kwargs={"name": "c", "op_id": "7"}, options={"queue": queue}
        )
        assert redis_client.llen(queue) == 0  # a worker must not see it before the commit
    [message] = queued(redis_client, queue)
    assert message["id"] == task_id
    assert message["task"] == "tests.increment"
    assert message["headers"]["idempotency_key"] == "counter:c:op:7"
    assert message["kwargs"] == {"name": "c", "op_id": "7"}


def test_nested_atomic_waits_for_the_outermost_commit(queue, redis_client) -> None:
    with transaction.atomic():
        with transaction.atomic():
            dispatch(Increment(), kwargs={"name": "n", "op_id": "1"}, options={"queue": queue})
        assert redis_client.llen(queue) == 0
        with pytest.raises(BusinessError), transaction.atomic():
            # A savepoint that rolls back takes its dispatch with it.
            dispatch(Increment(), kwargs={"name": "n", "op_id": "2"}, options={"queue": queue})
            raise BusinessError("inner block failed")
    assert [m["kwargs"]["op_id"] for m in queued(redis_client, queue)] == ["1"]


def test_outside_a_transaction_publishes_at_once(queue, redis_client) -> None:
    task_id = dispatch(Increment(), kwargs={"name": "now", "op_id": "1"}, options={"queue": queue})
    assert [m["id"] for m in queued(redis_client, queue)] == [task_id]


@pytest.mark.parametrize(
    ("task", "kwargs", "expected"),
    [
        (Increment(), {"name": "x"}, "missing a required argument: 'op_id'"),
        (Increment(), {"name": None, "op_id": "1"}, "idempotency key field 'name' is None"),
        (Increment(), {"name": "x", "op_id": "1", "colour": "red"}, "arguments do not fit"),
        (
            increment_unguarded,
            {"name": "x", "op_id": "1", "colour": "red"},
            "arguments do not fit run()",
        ),
        (Increment(), {"name": "x", "op_id": "1", "amount": object()}, "cannot be encoded"),
    ],
)
def test_bad_input_fails_at_the_call_inside_the_transaction(
    queue, redis_client, task, kwargs, expected
) -> None:
    with pytest.raises(BadInput, match=expected), transaction.atomic():
        Counter.objects.create(name="business")
        dispatch(task, kwargs=kwargs, options={"queue": queue})
    assert not Counter.objects.exists()  # the business transaction failed with it
    assert redis_client.llen(queue) == 0


def test_a_publish_failing_after_commit_is_logged_with_its_key_and_counted(queue, caplog) -> None:
    # A real client against a port nobody listens on: the broker is down at commit.
    dead_broker = Connection(f"redis://127.0.0.1:{free_port()}/0", connect_timeout=0.5)
    labels = {"task": "tests.increment", "error_class": "kombu.exceptions.OperationalError"}
    before = REGISTRY.get_sample_value("explicit_dispatch_publish_failed_total", labels) or 0.0
    after_commit: list[str] = []
    with (
        caplog.at_level(logging.ERROR, logger="django_outbox.outbox.dispatch"),
        transaction.atomic(),
    ):
        Counter.objects.create(name="paid")
        task_id = dispatch(
            Increment(),
            kwargs={"name": "paid", "op_id": "42"},
            options={"queue": queue, "connection": dead_broker, "retry": False},
        )
        transaction.on_commit(lambda: after_commit.append("later callback ran"))
    # The commit stands and is not reported as a failure; later callbacks still run.
    assert Counter.objects.filter(name="paid").exists()
    assert after_commit == ["later callback ran"]
    [record] = [r for r in caplog.records if r.name == "django_outbox.outbox.dispatch"]
    assert record.levelno == logging.ERROR
    assert record.idempotency_key == "counter:paid:op:42"  # type: ignore[attr-defined]
    assert record.job_id == task_id  # type: ignore[attr-defined]
    assert "counter:paid:op:42" in record.getMessage()
    assert "lost" in record.getMessage()
    assert REGISTRY.get_sample_value("explicit_dispatch_publish_failed_total", labels) == before + 1


def test_durable_dispatch_writes_the_outbox_row_in_the_transaction(queue, redis_client) -> None:
    with transaction.atomic():
        event_id = dispatch(
            Increment(),
            kwargs={"name": "d", "op_id": "1"},
            durable=True,
            ordering_key="counter:d",
            options={"queue": queue},
        )
    event = OutboxEvent.objects.get()
    assert str(event.event_id) == event_id
    assert event.task_name == "tests.increment"
    assert (event.args, event.kwargs) == ([], {"name": "d", "op_id": "1"})
    assert event.headers["idempotency_key"] == "counter:d:op:1"
    assert event.options == {"queue": queue}
    assert event.ordering_key == "counter:d"
    assert (event.status, event.attempts, event.published_at) == (OutboxStatus.PENDING, 0, None)
    assert redis_client.llen(queue) == 0  # the relay publishes it, not the writer


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (
            lambda: dispatch(
                Increment(),
                kwargs={"name": "j", "op_id": "1", "amount": Decimal("2")},
                durable=True,
            ),
            r"Task tests.increment: outbox payload kwargs\['amount'\] is a decimal.Decimal",
        ),
        (
            lambda: publish_event("tests.note", {"name": "j", "request_id": datetime.now(UTC)}),
            r"Task tests.note: outbox payload kwargs\['request_id'\] is a datetime.datetime",
        ),
        (
            lambda: publish_event("shop.unknown", {"lines": [{"sku": "a", "qty": {1, 2}}]}),
            r"kwargs\['lines'\]\[0\]\['qty'\] is a builtins.set",
        ),
        (
            lambda: publish_event("shop.unknown", {"note": "a\x00b"}),
            r"kwargs\['note'\] contains a NUL character",
        ),
        (
            lambda: publish_event("shop.unknown", {"ratio": float("nan")}),
            r"kwargs\['ratio'\] is nan, not a JSON number",
        ),
    ],
)
def test_a_payload_that_is_not_json_is_refused_inside_the_transaction(call, expected) -> None:
    with pytest.raises(BadInput, match=expected), transaction.atomic():
        Counter.objects.create(name="business")
        call()
    assert not Counter.objects.exists()
    assert not OutboxEvent.objects.exists()


def test_publish_event_checks_a_known_task_and_accepts_an_unknown_topic() -> None:
    with transaction.atomic():
        with pytest.raises(BadInput, match="missing a required argument: 'op_id'"):
            publish_event("tests.increment", {"name": "x"})
        publish_event("shop.no_such_task", {"anything": 1})
    assert list(OutboxEvent.objects.values_list("task_name", flat=True)) == ["shop.no_such_task"]


def test_durable_writes_outside_a_transaction_are_refused() -> None:
    with pytest.raises(TransactionManagementError, match="outside a transaction"):
        publish_event("tests.note", {"name": "x"})
    with pytest.raises(TransactionManagementError, match="outside a transaction"):
        dispatch(Increment(), kwargs={"name": "x", "op_id": "1"}, durable=True)
    assert not OutboxEvent.objects.exists()


def test_options_that_would_change_meaning_are_refused() -> None:
    with transaction.atomic():
        with pytest.raises(ValueError, match="task id is chosen by dispatch"):
            dispatch(Increment(), kwargs={"name": "x", "op_id": "1"}, options={"task_id": "t"})
        with pytest.raises(ValueError, match="ordering_key needs durable=True"):
            dispatch(Increment(), kwargs={"name": "x", "op_id": "1"}, ordering_key="k")
        with pytest.raises(ValueError, match=r"publish options \['countdown'\] cannot be stored"):
            dispatch(
                Increment(),
                kwargs={"name": "x", "op_id": "1"},
                durable=True,
                options={"countdown": 10},
            )
        with pytest.raises(ValueError, match="publish option queue=5 must be a str"):
            publish_event("tests.note", {"name": "x"}, options={"queue": 5})
