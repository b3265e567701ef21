"""The job path end to end, with real worker processes, PostgreSQL and Redis."""

from __future__ import annotations

import itertools
import json
import statistics
import time
import uuid
from typing import Any

import pytest
from kombu import Connection, Producer

from django_outbox.models import (
    Attempt,
    DeadLetter,
    DeadLetterReason,
    Outcome,
    ProcessedOperation,
)
from tests.celery_app import app
from tests.support.waiting import wait_for
from tests.testapp.models import Counter
from tests.testapp.tasks import (
    AlwaysTransient,
    Declined,
    Increment,
    NestedEffect,
    OptionalKey,
    RetryThenSucceed,
    Surprising,
    Throttled,
    note,
)

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def outcomes(**filters: object) -> list[str]:
    return sorted(Attempt.objects.filter(**filters).values_list("outcome", flat=True))


def test_duplicate_publish_is_absorbed_and_effect_applies_once(start_worker, queue):
    Counter.objects.create(name="a")
    start_worker()
    for _ in range(3):
        Increment().apply_async(kwargs={"name": "a", "op_id": "1"}, queue=queue)
    wait_for(lambda: Attempt.objects.count() == 3, what="3 attempts")
    assert Counter.objects.get(name="a").value == 1
    assert outcomes() == [Outcome.ALREADY_APPLIED, Outcome.ALREADY_APPLIED, Outcome.APPLIED]
    ledger = ProcessedOperation.objects.get()
    assert ledger.key == "counter:a:op:1"
    assert ledger.result_ref == "a+1"
    assert not DeadLetter.objects.exists()
    attempt = Attempt.objects.filter(outcome=Outcome.APPLIED).get()
    assert attempt.idempotency_key == "counter:a:op:1"
    assert attempt.attempt == 1
    assert attempt.worker_pid and attempt.worker_host
    assert attempt.finished_at >= attempt.started_at


def test_worker_killed_after_commit_redelivers_and_effect_is_not_repeated(start_worker, queue):
    Counter.objects.create(name="k")
    worker = start_worker()
    Increment().apply_async(
        kwargs={"name": "k", "op_id": "9", "die_after_effect": True}, queue=queue
    )
    # The first execution commits, then SIGKILLs its own pool process before the ack;
    # reject_on_worker_lost puts the message back and a new child runs it again. The
    # killed attempt's row committed with its effect, so both attempts are on record.
    wait_for(
        lambda: outcomes() == [Outcome.ALREADY_APPLIED, Outcome.APPLIED],
        timeout=40,
        what="the redelivered execution",
    )
    first, second = Attempt.objects.order_by("started_at")
    assert first.task_id == second.task_id
    assert first.worker_pid != second.worker_pid
    assert Counter.objects.get(name="k").value == 1
    assert ProcessedOperation.objects.filter(key="counter:k:op:9").count() == 1
    assert "WorkerLostError" in worker.log() or "signal 9" in worker.log()


def test_same_key_with_other_arguments_is_a_conflict_dead_letter(start_worker, queue):
    Counter.objects.create(name="c")
    start_worker()
    Increment().apply_async(kwargs={"name": "c", "op_id": "1", "amount": 1}, queue=queue)
    wait_for(lambda: outcomes() == [Outcome.APPLIED], what="first apply")
    Increment().apply_async(kwargs={"name": "c", "op_id": "1", "amount": 5}, queue=queue)
    # The dead letter commits first and the attempt row just after: wait for the row.
    wait_for(lambda: outcomes() == [Outcome.APPLIED, Outcome.CONFLICT], what="the conflict")
    letter = DeadLetter.objects.get()
    assert letter.reason == DeadLetterReason.CONFLICT
    assert letter.idempotency_key == "counter:c:op:1"
    assert "already applied with different arguments" in letter.error_message
    assert letter.kwargs["amount"] == 5
    assert Counter.objects.get(name="c").value == 1
    assert outcomes() == [Outcome.APPLIED, Outcome.CONFLICT]


def test_retry_delays_are_spread_capped_and_exhaustion_dead_letters(start_worker, queue):
    start_worker(concurrency=2)
    jobs = [f"j{i}" for i in range(16)]
    for job in jobs:
        AlwaysTransient().apply_async(args=[job], queue=queue)
    # Each dead letter commits just before its attempt row: wait for both.
    wait_for(
        lambda: (
            DeadLetter.objects.count() == len(jobs)
            and Attempt.objects.filter(outcome=Outcome.EXHAUSTED).count() == len(jobs)
        ),
        timeout=60,
        what="every job exhausted",
    )
    letters = DeadLetter.objects.all()
    assert {d.reason for d in letters} == {DeadLetterReason.EXHAUSTED}
    assert {d.attempts for d in letters} == {4}
    for letter in letters:  # first seen: the first attempt, not the dead-lettering
        first = Attempt.objects.filter(task_id=letter.task_id, attempt=1).get()
        assert letter.first_seen == first.started_at
        assert letter.last_attempt > first.finished_at
    # max_attempts=4: three retries scheduled, then exhausted: exactly four executions.
    for job in jobs:
        rows = list(Attempt.objects.filter(idempotency_key=f"transient:{job}").order_by("attempt"))
        assert [r.attempt for r in rows] == [1, 2, 3, 4]
        assert [r.outcome for r in rows] == [Outcome.RETRY_SCHEDULED] * 3 + [Outcome.EXHAUSTED]
        for before, after in itertools.pairwise(rows):
            # The next attempt did not start before its scheduled time.
            assert after.started_at >= before.next_attempt_at - _ms(30)
    delays = list(
        Attempt.objects.filter(outcome=Outcome.RETRY_SCHEDULED).values_list(
            "attempt", "retry_delay"
        )
    )
    for attempt, delay in delays:
        assert 0 <= delay <= min(1.0, 0.2 * 2 ** (attempt - 1))
    values = [d for _, d in delays]
    # Full jitter: 48 delays are (almost surely) all different and spread out.
    assert len(set(values)) == len(values)
    assert statistics.pstdev(values) > 0.05
    third = [d for a, d in delays if a == 3]
    assert max(third) - min(third) > 0.25


def test_retry_after_from_the_exception_wins_over_backoff(start_worker, queue):
    start_worker()
    Throttled().apply_async(args=["t1"], queue=queue)
    wait_for(
        lambda: (
            DeadLetter.objects.exists()
            and Attempt.objects.filter(outcome=Outcome.EXHAUSTED).exists()
        ),
        what="exhausted after one retry",
    )
    first, second = Attempt.objects.order_by("attempt")
    assert first.retry_delay == 1.5
    assert (second.started_at - first.finished_at).total_seconds() >= 1.4
    assert second.outcome == Outcome.EXHAUSTED


def test_retry_then_success_applies_once(start_worker, queue):
    Counter.objects.create(name="r")
    start_worker()
    RetryThenSucceed().apply_async(args=["r", 2], queue=queue)
    wait_for(
        lambda: Attempt.objects.filter(outcome=Outcome.APPLIED).exists(),
        what="applied after two retries",
    )
    rows = list(Attempt.objects.order_by("attempt"))
    assert [r.outcome for r in rows] == [
        Outcome.RETRY_SCHEDULED,
        Outcome.RETRY_SCHEDULED,
        Outcome.APPLIED,
    ]
    assert rows[1].retry_delay == 0.05  # RetryAfter(0.05) on the second attempt
    assert len({r.task_id for r in rows}) == 1  # a retry is the same job
    assert Counter.objects.get(name="r").value == 1


def test_more_retries_than_celerys_default_limit_of_three_still_run(start_worker, queue):
    # Celery's own max_retries (3) must not end the job early: max_attempts=5 allows four
    # retries. With Celery's limit the fourth retry re-raised the error instead: the job
    # failed silently after an attempt row that said a retry was scheduled.
    Counter.objects.create(name="r4")
    start_worker()
    RetryThenSucceed().apply_async(args=["r4", 4], queue=queue)
    wait_for(
        lambda: Attempt.objects.filter(outcome=Outcome.APPLIED).exists(),
        timeout=30,
        what="applied after four retries",
    )
    assert outcomes() == [Outcome.APPLIED] + [Outcome.RETRY_SCHEDULED] * 4
    assert Counter.objects.get(name="r4").value == 1


def test_permanent_error_dead_letters_after_exactly_one_attempt(start_worker, queue):
    start_worker()
    Declined().apply_async(args=[42], queue=queue)
    Surprising().apply_async(args=["widget"], queue=queue)
    wait_for(lambda: DeadLetter.objects.count() == 2, what="two dead letters")
    declined = DeadLetter.objects.get(task_name="tests.declined")
    assert declined.reason == DeadLetterReason.PERMANENT
    assert declined.attempts == 1
    assert declined.error_class == "builtins.ValueError"
    assert declined.args == [42]
    assert declined.idempotency_key == "payment:42:capture"
    assert "card declined" in declined.traceback
    surprising = DeadLetter.objects.get(task_name="tests.surprising")
    assert surprising.reason == DeadLetterReason.UNCLASSIFIED
    time.sleep(1.0)  # nothing retries behind our back
    assert outcomes(task_name="tests.declined") == [Outcome.FAILED_PERMANENT]
    assert outcomes(task_name="tests.surprising") == [Outcome.FAILED_UNCLASSIFIED]


def _publish(queue: str, body: bytes, headers: dict[str, Any] | None = None) -> None:
    """``body`` as it is (JSON's content type), with ``headers`` (none: protocol 1)."""
    with Connection(app.conf.broker_url) as conn:
        Producer(conn).publish(
            body,
            routing_key=queue,
            headers=headers or {},
            content_type="application/json",
            content_encoding="utf-8",
        )


def _headers(task_id: str, **more: Any) -> dict[str, Any]:
    """Celery's protocol-2 headers of a ``tests.increment`` message, then ``more``."""
    headers, _properties, _body, _ = app.amqp.as_task_v2(
        task_id, "tests.increment", args=(), kwargs={}
    )
    return {**headers, **more}


def test_bad_input_is_dead_lettered_on_first_delivery_and_worker_keeps_consuming(
    start_worker, queue
):
    Counter.objects.create(name="after")
    worker = start_worker()
    wrong_args = app.send_task(
        "tests.increment", args=["x", "1", 1, 0, False, "extra"], queue=queue
    )
    missing_key = app.send_task("tests.optional_key", queue=queue)
    unknown = app.send_task("shop.no_such_task", args=[1], queue=queue)
    undecodable_id = str(uuid.uuid4())
    _publish(queue, b"{this is not json", _headers(undecodable_id))
    # Valid JSON, but not Celery's [args, kwargs, embed]: it fails in the pool child.
    misshapen_id = str(uuid.uuid4())
    _publish(queue, b'"just a string"', _headers(misshapen_id))
    # Celery protocol 1 (everything in the body) with an id that is a number, not a
    # string: it reaches the task, whose dead letter must still be written.
    numeric_id = 10**12 + 7
    _publish(
        queue,
        json.dumps(
            {"task": "tests.increment", "id": numeric_id, "args": ["x", "1", 1, 0, False, "extra"],
             "kwargs": {}, "retries": 0, "eta": None, "expires": None, "utc": True}
        ).encode(),
    )  # fmt: skip
    Increment().apply_async(kwargs={"name": "after", "op_id": "1"}, queue=queue)

    wait_for(
        lambda: DeadLetter.objects.count() == 6,
        what="six bad-input dead letters",
        on_timeout=lambda: (
            list(DeadLetter.objects.values("task_name", "error_message")),
            worker.log()[-3000:],
        ),
    )
    wait_for(lambda: Counter.objects.get(name="after").value == 1, what="the good job")
    letters = {d.task_id: d for d in DeadLetter.objects.all()}
    # An unknown task name has its own word, as when the outbox relay meets one.
    assert {t: d.reason for t, d in letters.items() if d.reason != DeadLetterReason.BAD_INPUT} == {
        unknown.id: DeadLetterReason.UNKNOWN_TASK
    }
    assert "tests.increment: arguments do not fit run" in letters[wrong_args.id].error_message
    assert letters[wrong_args.id].args == ["x", "1", 1, 0, False, "extra"]
    assert (
        "tests.optional_key: idempotency key field 'thing_id' is missing"
        in letters[missing_key.id].error_message
    )
    assert "unknown task name 'shop.no_such_task'" in letters[unknown.id].error_message
    assert letters[unknown.id].args == [1]
    assert "does not decode" in letters[undecodable_id].error_message
    assert letters[undecodable_id].raw_body == "{this is not json"
    assert "is not [args, kwargs, embed]" in letters[misshapen_id].error_message
    assert letters[misshapen_id].raw_body == '"just a string"'
    assert "tests.increment: arguments do not fit run" in letters[str(numeric_id)].error_message
    assert worker.alive()
    time.sleep(0.5)  # none of them is retried
    assert DeadLetter.objects.count() == 6
    assert outcomes(outcome=Outcome.BAD_INPUT) == [Outcome.BAD_INPUT] * 3


def test_a_message_with_wrong_stamps_is_dead_lettered_and_the_worker_lives_on(start_worker, queue):
    """Celery looks stamped header names up in a dict in the worker's main process when
    it sends the request to the pool: for a request that waited for a free process, a
    name that is a list would stop the whole worker (tests/chaos/test_unexpected_bodies.py,
    seed 5c6ca7b2ea)."""
    Counter.objects.bulk_create([Counter(name="after"), Counter(name="busy")])
    worker = start_worker(concurrency=1, prefetch_multiplier=4)
    # The one process is busy: the stamped message, prefetched, waits for it (the pool's
    # semaphore).
    Increment().apply_async(kwargs={"name": "busy", "op_id": "1", "hold": 2.0}, queue=queue)
    wait_for(lambda: "] received" in worker.log(), what="the busy job received")
    task_id = str(uuid.uuid4())
    _publish(
        queue,
        json.dumps([[], {"name": "after", "op_id": "stamped"}, {}]).encode(),
        _headers(task_id, stamped_headers=[[], {}], stamps={}),
    )
    Increment().apply_async(kwargs={"name": "after", "op_id": "1"}, queue=queue)
    wait_for(
        lambda: DeadLetter.objects.filter(task_id=task_id).exists(),
        what="the stamped message's dead letter",
        on_timeout=lambda: worker.log()[-3000:],
    )
    letter = DeadLetter.objects.get(task_id=task_id)
    assert letter.reason == DeadLetterReason.BAD_INPUT
    assert "stamped_headers is not a list of header names" in letter.error_message
    wait_for(lambda: Counter.objects.get(name="after").value == 1, what="the next job")
    assert worker.alive()


def test_decorator_form_task_runs_with_module_level_effect(start_worker, queue):
    Counter.objects.create(name="n")
    start_worker()
    note.apply_async(args=["n"], queue=queue)
    note.apply_async(args=["n"], queue=queue)
    wait_for(lambda: Attempt.objects.count() == 2, what="two attempts")
    assert Counter.objects.get(name="n").value == 1
    assert outcomes() == [Outcome.ALREADY_APPLIED, Outcome.APPLIED]


def test_an_effect_inside_the_handlers_own_atomic_is_recorded_once_it_is_known(
    start_worker, queue
) -> None:
    Counter.objects.bulk_create([Counter(name="ok"), Counter(name="bad")])
    start_worker()
    NestedEffect().apply_async(args=["ok", False], queue=queue)
    NestedEffect().apply_async(args=["bad", True], queue=queue)
    wait_for(lambda: Attempt.objects.count() == 2, what="both attempts")
    assert dict(Attempt.objects.values_list("idempotency_key", "outcome")) == {
        "nested:ok": Outcome.APPLIED,
        "nested:bad": Outcome.FAILED_PERMANENT,
    }
    assert Counter.objects.get(name="ok").value == 1
    assert Counter.objects.get(name="bad").value == 0  # the outer rollback took the effect
    assert list(ProcessedOperation.objects.values_list("key", flat=True)) == ["nested:ok"]


def test_key_travels_in_headers_from_publish(redis_client, queue):
    Increment().apply_async(kwargs={"name": "h", "op_id": "77"}, queue=queue)
    raw = redis_client.lpop(queue)
    assert raw is not None
    message = json.loads(raw)
    assert message["headers"]["idempotency_key"] == "counter:h:op:77"


def test_publish_with_bad_arguments_fails_at_the_caller(redis_client, queue):
    from celery_explicit import BadInput

    with pytest.raises(BadInput, match=r"tests\.increment: arguments do not fit"):
        Increment().apply_async(kwargs={"nam": "h", "op_id": "1"}, queue=queue)
    with pytest.raises(BadInput, match=r"tests\.optional_key: idempotency key field 'thing_id'"):
        OptionalKey().apply_async(queue=queue)
    assert redis_client.llen(queue) == 0


def _ms(n: int):  # type: ignore[no-untyped-def]
    import datetime as dt

    return dt.timedelta(milliseconds=n)
