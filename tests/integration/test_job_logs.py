"""What a real worker logs: every line we write names the task, job id and key in its
text (Celery's own format), every field as data with the JSON formatter of the docs'
LOGGING snippet; one line per attempt at the level its ending deserves; the correlation
id carried from the caller to the jobs a handler publishes; sensitive fields never
written in the clear."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pytest
from django.db import transaction

from celery_explicit import correlation
from django_outbox.models import Attempt, DeadLetter, Outcome
from tests.support.waiting import wait_for
from tests.testapp.models import Counter
from tests.testapp.tasks import CapturePayment, Declined, FanOut, Increment, Surprising

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def log_once(worker: Any, done: Any, what: str) -> str:
    """The worker's log, once ``done(log)`` holds."""

    def read() -> str | None:
        text: str = worker.log()
        return text if done(text) else None

    result: str = wait_for(read, timeout=10, what=what)
    return result


def log_lines(log: str) -> list[str]:
    return log.splitlines()


def test_celerys_default_format_names_the_job_and_levels_follow_the_ending(
    start_worker, queue
) -> None:
    name = f"log{uuid.uuid4().hex[:6]}"
    Counter.objects.create(name=name)
    worker = start_worker(extra_env={"EXPLICIT_TEST_LOG_STYLE": "celery"})
    applied = Increment().apply_async(kwargs={"name": name, "op_id": "1"}, queue=queue).id
    declined = Declined().apply_async(args=[int(uuid.uuid4().int % 10**8)], queue=queue).id
    surprise = Surprising().apply_async(args=["parcel"], queue=queue).id
    wait_for(lambda: Attempt.objects.count() == 3, what="three attempts")
    log = log_once(worker, lambda t: t.count("ended:") >= 3, "three attempt lines")

    line = next(ln for ln in log_lines(log) if applied in ln and "ended:" in ln)
    # [time: INFO/ForkPoolWorker-n] tests.increment[<id>] key=counter:...: attempt 1 ended
    assert re.search(
        rf"INFO/ForkPoolWorker-\d+\] tests\.increment\[{applied}\] "
        rf"key=counter:{name}:op:1: attempt 1 ended: applied in \d+ ms",
        line,
    ), line

    declined_line = next(ln for ln in log_lines(log) if declined in ln and "ended:" in ln)
    assert "WARNING/" in declined_line and "failed_permanent" in declined_line
    assert "ValueError: card declined" in declined_line
    # Declared: Celery's line is one INFO "raised expected", no ERROR, no traceback.
    celery_lines = [ln for ln in log_lines(log) if f"[{declined}] raised" in ln]
    assert celery_lines and all("raised expected" in ln for ln in celery_lines), celery_lines
    assert "raised unexpected: ValueError" not in log

    surprise_line = next(ln for ln in log_lines(log) if surprise in ln and "ended:" in ln)
    assert "ERROR/" in surprise_line and "failed_unclassified" in surprise_line
    after = log.split(surprise_line, 1)[1]
    assert after.lstrip("\n").startswith("Traceback"), after[:300]  # ours carries it


def test_the_json_formatter_gives_every_field_as_data(start_worker, queue) -> None:
    name = f"json{uuid.uuid4().hex[:6]}"
    Counter.objects.create(name=name)
    worker = start_worker(extra_env={"EXPLICIT_TEST_LOG_STYLE": "json"})
    with correlation.use("req-7f3a"):
        job = Increment().apply_async(kwargs={"name": name, "op_id": "1"}, queue=queue).id
    wait_for(lambda: Attempt.objects.filter(task_id=job).exists())
    record: dict[str, Any] = wait_for(
        lambda: next(
            (
                r
                for r in (json.loads(ln) for ln in log_lines(worker.log()) if ln.startswith("{"))
                if r.get("job_id") == job and r.get("outcome")
            ),
            None,
        ),
        timeout=10,
        what="the attempt's JSON line",
    )
    assert record["task"] == "tests.increment"
    assert record["idempotency_key"] == f"counter:{name}:op:1"
    assert record["correlation_id"] == "req-7f3a"
    assert record["attempt"] == 1 and record["deliveries"] == 1
    assert record["outcome"] == "applied" and record["levelname"] == "INFO"
    # Step durations: queue wait, the lease acquire (its step), handler, commit.
    for part in ("queue_wait_ms", "execution_lease_ms", "handler_ms", "commit_ms"):
        assert isinstance(record[part], float) and record[part] >= 0, (part, record)
    assert record["duration_ms"] >= record["commit_ms"]


def test_the_correlation_id_travels_from_the_caller_through_every_path(
    start_worker, start_relay, queue
) -> None:
    from django_outbox.outbox.dispatch import dispatch

    tag = uuid.uuid4().hex[:6]
    names = [f"fan{tag}{i}" for i in range(2)] + [f"oc{tag}", f"ob{tag}", f"new{tag}"]
    for name in names:
        Counter.objects.create(name=name)
    start_worker()
    start_relay()
    with correlation.use("checkout-42"):
        # A job, which publishes two more from its handler.
        FanOut().apply_async(args=["1", names[:2], queue], queue=queue)
        with transaction.atomic():
            dispatch(Increment(), kwargs={"name": names[2], "op_id": "1"}, options={"queue": queue})
            dispatch(
                Increment(),
                kwargs={"name": names[3], "op_id": "1"},
                durable=True,
                options={"queue": queue},
            )
    # No context at all: one is born at the publish.
    Increment().apply_async(kwargs={"name": names[4], "op_id": "1"}, queue=queue)
    wait_for(lambda: Attempt.objects.filter(outcome=Outcome.APPLIED).count() == 5, timeout=30)
    rows = {a.idempotency_key: a for a in Attempt.objects.all()}
    for name in names[:4]:
        assert rows[f"counter:{name}:op:1"].correlation_id == "checkout-42", name
    assert rows["fan_out:1"].correlation_id == "checkout-42"
    born = rows[f"counter:{names[4]}:op:1"]
    assert re.fullmatch(r"[0-9a-f]{32}", born.correlation_id), born.correlation_id
    assert born.correlation_id != born.task_id


def test_a_sensitive_field_is_never_kept_or_logged_in_the_clear(start_worker, queue) -> None:
    card = "4111111111111111"
    payment = int(uuid.uuid4().int % 10**8)
    worker = start_worker(extra_env={"EXPLICIT_TEST_LOG_STYLE": "celery"})
    CapturePayment().apply_async(args=[payment], kwargs={"card_number": card}, queue=queue)
    letter = wait_for(lambda: DeadLetter.objects.filter(task_name="tests.capture_payment").first())
    assert letter.args == [payment] and letter.kwargs == {"card_number": "[redacted]"}
    assert card not in letter.error_message and "[redacted]" in letter.error_message
    assert card not in letter.traceback
    attempt = Attempt.objects.get(task_name="tests.capture_payment")
    assert card not in attempt.error_message
    log = log_once(worker, lambda t: "raised expected" in t, "Celery's line")
    assert card not in log, [ln for ln in log_lines(log) if card in ln]
    # The dead letter cannot be replayed with its card number gone: refused, with why.
    from django_outbox.store import dead_letters

    refusal = dead_letters.replay_refusal(letter)
    assert "sensitive arguments redacted (card_number)" in refusal


def test_a_declared_sensitive_field_must_be_a_run_parameter() -> None:
    from celery_explicit import ExplicitTask
    from celery_explicit.errors import ContractError

    with pytest.raises(ContractError) as caught:

        class Leaky(ExplicitTask):
            name = "tests.leaky"
            idempotency_key = "leaky:{order_id}"
            visibility_timeout = 30
            expected_duration = 1
            retry_on = ()
            fail_on = ()
            sensitive = ("card",)

            def run(self, order_id: int, card_number: str) -> None:
                return None

    assert caught.value.task_name == "tests.leaky" and caught.value.field == "sensitive"
    assert "'card', which is not a parameter of run()" in str(caught.value)
