"""``manage.py explicit_explain`` on real histories: jobs run by real workers, explained from the
rows they left. Each verdict must name the right causes and counts."""

from __future__ import annotations

import subprocess
import sys
import uuid
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from django_outbox.models import Attempt, DeadLetter, Outcome, ProcessedOperation
from tests.support.explaining import explain, explain_json, verdict_of
from tests.support.processes import ROOT, project_env
from tests.support.waiting import wait_for
from tests.testapp.models import Counter
from tests.testapp.tasks import Declined, Increment, RetryThenSucceed

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def test_a_message_published_three_times_applied_once(start_worker, queue) -> None:
    name = f"dup{uuid.uuid4().hex[:6]}"
    Counter.objects.create(name=name)
    start_worker()
    for _ in range(3):
        Increment().apply_async(kwargs={"name": name, "op_id": "1"}, queue=queue)
    wait_for(lambda: Attempt.objects.filter(task_name="tests.increment").count() == 3)
    applied = Attempt.objects.get(outcome=Outcome.APPLIED)
    text = explain(f"counter:{name}:op:1")
    verdict = verdict_of(text)
    assert "effect applied once at" in verdict
    assert f"by {applied.worker_host} pid {applied.worker_pid}" in verdict
    assert "ran 3 times" in verdict and "2 duplicate executions absorbed" in verdict
    # Every attempt is on the timeline, with millisecond times, and the ledger row.
    assert text.count(" attempt 1 of task ") == 3
    assert "effect applied: ledger entry" in text
    data = explain_json(f"counter:{name}:op:1")
    [match] = data["matches"]
    assert [e["kind"] for e in match["events"]].count("attempt") == 3
    assert match["verdict"] == verdict.split("verdict: ", 1)[1]
    assert len(match["task_ids"]) == 3


def test_retries_then_success_name_each_retrys_error(start_worker, queue) -> None:
    name = f"r{uuid.uuid4().hex[:6]}"
    Counter.objects.create(name=name)
    start_worker()
    result = RetryThenSucceed().apply_async(args=[name, 2], queue=queue)
    wait_for(lambda: ProcessedOperation.objects.filter(key=f"flaky:{name}").exists())
    wait_for(lambda: Attempt.objects.filter(outcome=Outcome.APPLIED).exists())
    verdict = verdict_of(explain(result.id))  # found by its task id
    assert "effect applied once" in verdict
    assert "ran 3 times" in verdict
    assert "2 retries after TransientError, RetryAfter" in verdict
    events = explain_json(f"flaky:{name}")["matches"][0]["events"]
    delays = [e["data"]["retry_delay"] for e in events if e["kind"] == "attempt"]
    assert delays[1] == 0.05 and delays[2] is None  # RetryAfter(0.05), then applied


def test_a_permanent_failure_found_by_business_id_and_dead_letter_id(start_worker, queue):
    payment = int(uuid.uuid4().int % 10**8) + 10**8
    start_worker()
    Declined().apply_async(args=[payment], queue=queue)
    wait_for(lambda: Attempt.objects.filter(outcome=Outcome.FAILED_PERMANENT).exists())
    letter = DeadLetter.objects.get(idempotency_key=f"payment:{payment}:capture")
    for what in (str(payment), str(letter.pk)):
        verdict = verdict_of(explain(what))
        assert "effect not applied: dead-lettered (permanent, ValueError)" in verdict
        assert f"dead letter {letter.pk}" in verdict
        assert "ran 1 time" in verdict


def test_a_replay_on_real_workers_that_fails_again_is_followed_to_its_new_letter(
    start_worker, queue
) -> None:
    """Dead-lettered, replayed by an operator, dead-lettered again: explain follows the
    chain from the first letter to the second, from the rows the workers left."""
    from django_outbox.store import dead_letters

    payment = int(uuid.uuid4().int % 10**8) + 2 * 10**8
    key = f"payment:{payment}:capture"
    start_worker()
    Declined().apply_async(args=[payment], queue=queue)
    first = wait_for(lambda: DeadLetter.objects.filter(idempotency_key=key).first())
    replay_id = dead_letters.replay(first, by="oncall")
    again = wait_for(lambda: DeadLetter.objects.filter(task_id=replay_id).first())
    text = explain(key)
    assert f"replayed as task {replay_id}" in text, text
    assert f"which was dead-lettered again (permanent, dead letter {again.pk})" in text, text
    verdict = verdict_of(text)
    assert "ran 2 times" in verdict and "replayed from the dead letters (1 attempt(s))" in verdict
    assert f"dead letter {again.pk}" in verdict
    # The replayed attempt links back to the first letter.
    assert Attempt.objects.get(task_id=replay_id).replay_of == first.pk


def test_a_conflict_is_named_beside_the_applied_effect(start_worker, queue) -> None:
    name = f"c{uuid.uuid4().hex[:6]}"
    Counter.objects.create(name=name)
    start_worker()
    Increment().apply_async(kwargs={"name": name, "op_id": "1", "amount": 1}, queue=queue)
    wait_for(lambda: Attempt.objects.filter(outcome=Outcome.APPLIED).exists())
    Increment().apply_async(kwargs={"name": name, "op_id": "1", "amount": 5}, queue=queue)
    wait_for(lambda: Attempt.objects.filter(outcome=Outcome.CONFLICT).exists())
    verdict = verdict_of(explain(f"counter:{name}:op:1"))
    assert "effect applied once" in verdict
    assert "ran 2 times" in verdict
    assert "dead-lettered: 1 conflict" in verdict


def test_one_business_id_lists_every_job_it_is_part_of(db) -> None:
    from django.utils import timezone

    order = str(uuid.uuid4().int % 10**9)
    now = timezone.now()
    for key in (f"order:{order}:ship", f"payment:{order}:capture", f"order:{order}1:ship"):
        ProcessedOperation.objects.create(
            key=key, task_name="t", task_id=str(uuid.uuid4()), fingerprint="f", processed_at=now
        )
    keys = [m["key"] for m in explain_json(order)["matches"]]
    # A part of the key, never a prefix of another id (order 10031 is not order 1003).
    assert keys == [f"order:{order}:ship", f"payment:{order}:capture"]


@pytest.mark.parametrize("what", ["no-such-job-anywhere", "bad\x01input", "x" * 300])
def test_unknown_or_malformed_input_is_one_line_and_exit_status_1(what: str) -> None:
    """Through the real command line: one line on stderr, status 1, no traceback."""
    env = project_env(db_name=connection.settings_dict["NAME"], queue="unused")
    done = subprocess.run(
        [sys.executable, "-m", "django", "explicit_explain", what],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stdout == ""


def test_deferrals_are_counted_on_the_attempt_that_runs_and_explained(start_worker, queue):
    """Job 2 of an order delivered before job 1 waits its turn (deferred, re-published):
    the attempt that finally runs carries the count, and the verdict names it."""
    from tests.testapp.tasks import ApplyOrderEvent

    order = int(uuid.uuid4().int % 10**9)
    tag = uuid.uuid4().hex[:6]
    start_worker()
    # Numbers are taken at publish: job 1 first, but held back 5 s by a countdown (job 2
    # must be handled before job 1 is due, even on a loaded machine).
    ApplyOrderEvent().apply_async(args=[order, 1, tag], queue=queue, countdown=5)
    ApplyOrderEvent().apply_async(args=[order, 2, tag], queue=queue)
    wait_for(lambda: Attempt.objects.filter(idempotency_key=f"order:{order}:event:2").exists())
    second = Attempt.objects.get(idempotency_key=f"order:{order}:event:2")
    assert second.deferrals and second.deferrals["ordering"] >= 1
    assert second.published_via == "direct"
    verdict = verdict_of(explain(f"order:{order}:event:2"))
    assert f"deferred {second.deferrals['ordering']} time" in verdict
    assert "waiting for its entity's turn" in verdict


def test_the_publish_path_is_recorded(start_worker, start_relay, queue) -> None:
    from django.db import transaction

    from django_outbox.outbox.dispatch import dispatch

    names = {path: f"{path}{uuid.uuid4().hex[:6]}" for path in ("on_commit", "outbox")}
    for name in names.values():
        Counter.objects.create(name=name)
    start_worker()
    start_relay()
    with transaction.atomic():
        dispatch(
            Increment(), kwargs={"name": names["on_commit"], "op_id": "1"}, options={"queue": queue}
        )
        dispatch(
            Increment(),
            kwargs={"name": names["outbox"], "op_id": "1"},
            durable=True,
            options={"queue": queue},
        )
    wait_for(lambda: Attempt.objects.filter(outcome=Outcome.APPLIED).count() == 2, timeout=30)
    for path, name in names.items():
        row = Attempt.objects.get(idempotency_key=f"counter:{name}:op:1")
        assert row.published_via == path
        assert f"published {path.replace('_', ' ')}" in explain(f"counter:{name}:op:1")


def test_a_replay_shows_what_it_led_to(db) -> None:
    """A replayed letter says whether its replay applied or was dead-lettered again."""
    from django.utils import timezone

    from django_outbox.models import DeadLetterReason, DeadLetterStatus

    now = timezone.now()
    key = f"payment:{uuid.uuid4().int % 10**9}:capture"
    first, replay = str(uuid.uuid4()), str(uuid.uuid4())

    def letter(task_id: str, **kw: Any) -> DeadLetter:
        return DeadLetter.objects.create(
            task_id=task_id,
            task_name="tests.declined",
            idempotency_key=key,
            reason=DeadLetterReason.PERMANENT,
            error_class="builtins.ValueError",
            first_seen=now,
            last_attempt=now,
            **kw,
        )

    def ran(task_id: str, outcome: str, **kw: Any) -> None:
        Attempt.objects.create(
            task_id=task_id,
            task_name="tests.declined",
            idempotency_key=key,
            attempt=1,
            started_at=now,
            finished_at=now,
            duration_ms=1.0,
            outcome=outcome,
            **kw,
        )

    original = letter(first, status=DeadLetterStatus.REPLAYED, replayed_task_id=replay)
    ran(first, Outcome.FAILED_PERMANENT)
    ran(replay, Outcome.FAILED_PERMANENT, replay_of=original.pk)
    again = letter(replay)
    text = explain(key)
    assert f"which was dead-lettered again (permanent, dead letter {again.pk})" in text
    again.delete()
    Attempt.objects.filter(task_id=replay).update(outcome=Outcome.APPLIED)
    events = explain_json(key)["matches"][0]["events"]
    [event] = [e for e in events if e["kind"] == "dead_letter"]
    assert event["data"]["replay_led_to"] == "ended applied"


def test_a_key_only_dead_letters_hold_is_explained() -> None:
    """A job no worker ran (the relay's letter, an unknown task's) has no attempt row."""
    from django_outbox.incident import explain

    DeadLetter.objects.create(
        task_id="t-relay",
        task_name="shop.ship_order",
        idempotency_key="order:ORD-8:ship",
        reason="not_received",
        first_seen=timezone.now(),
        last_attempt=timezone.now(),
    )
    (found,) = explain.explain("order:ORD-8:ship")
    assert found.matched_by == "idempotency key"
    assert "never received" in found.verdict or "dead-lettered" in found.verdict, found.verdict
