"""``explain`` tells every execution and why it was repeated, from real histories.

A pool process killed mid-job writes no attempt row: the takeover that follows keeps its
host, pid, start and cause in the fence row, and ``explain`` counts it and puts it on the
timeline. Each cause has its control: a holder stopped past its lease (alive, not dead)
is ``lease_expired``. Dead letters closed by an operator stay in the verdict with who
closed them and when; a bare number says which rule each match came from.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from typing import Any

import pytest

from django_outbox import times
from django_outbox.models import Attempt, DeadLetter, Fence, Outcome
from django_outbox.store import dead_letters
from tests.support.explaining import explain, explain_json, verdict_of
from tests.support.waiting import wait_for
from tests.testapp.models import Counter, Profile
from tests.testapp.tasks import Declined, HoldsTheLine, Increment, ShipToAddress

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def hold(redis_client, queue: str, seconds: float) -> tuple[str, int]:  # type: ignore[no-untyped-def]
    """Publish a job that runs ``seconds``; its key and the pid of its first execution."""
    op = uuid.uuid4().hex[:8]
    Counter.objects.create(name=op)
    HoldsTheLine().apply_async(kwargs={"name": op, "op_id": op, "seconds": seconds}, queue=queue)
    pid = wait_for(lambda: redis_client.lindex(f"started:{op}", 0), what="the first execution")
    return f"line:{op}:{op}", int(pid)


def applied(key: str) -> Attempt:
    return wait_for(
        lambda: Attempt.objects.filter(idempotency_key=key, outcome=Outcome.APPLIED).first(),
        timeout=60,
        what=f"the execution of {key} that applies",
    )


def assert_killed_execution_told(key: str, killed_pid: int) -> dict[str, Any]:
    """The killed execution is counted and on the timeline with its host, pid and start;
    the takeover names its cause: its holder died."""
    fence = Fence.objects.get(idempotency_key=key)
    assert fence.cause == "holder_dead", fence.cause
    assert fence.taken_over_from.endswith(f":{killed_pid}")
    assert fence.holder_started_at is not None
    assert not Attempt.objects.filter(idempotency_key=key, worker_pid=killed_pid).exists()
    text = explain(key)
    verdict = verdict_of(text)
    assert "ran 2 times" in verdict, text
    assert "1 lease takeover after its holder died" in verdict, text
    assert f"pid {killed_pid}, which left no attempt row" in verdict, text
    assert "after the lease expired" not in verdict, text
    [match] = explain_json(key)["matches"]
    [died] = [e for e in match["events"] if e["kind"] == "execution"]
    assert died["data"]["worker_pid"] == killed_pid
    assert died["data"]["ended"] == "died" and died["data"]["cause"] == "holder_dead"
    assert died["data"]["worker_host"] and died["data"]["started_at"].endswith("+00:00")
    assert died["at"] == died["data"]["started_at"]
    # The publish comes first, then the killed execution, then the one that applied.
    kinds = [e["kind"] for e in match["events"]]
    assert kinds.index("published") < kinds.index("execution") < kinds.index("attempt")
    return match


def test_a_pool_process_killed_mid_job_is_counted_with_its_cause(start_worker, redis_client):
    worker = start_worker(concurrency=1)
    key, pid = hold(redis_client, worker.queue, seconds=2)
    os.kill(pid, signal.SIGKILL)
    applied(key)
    match = assert_killed_execution_told(key, pid)
    # The execution that ran again waited for nothing but the pool's new process: its
    # attempt says how long after the publish it started.
    [attempt] = [e for e in match["events"] if e["kind"] == "attempt"]
    assert "after its message was published" in attempt["text"]
    assert "published again" not in attempt["text"]


def test_a_whole_worker_killed_mid_job_is_counted_with_its_cause(start_worker, redis_client):
    """The worker and its pool die together; its message comes back once its visibility
    lease has run out, to another worker. The dead holder's lease ran out too, but its
    process is gone on this host: it died, it was not merely late."""
    first = start_worker(concurrency=1)
    key, pid = hold(redis_client, first.queue, seconds=2)
    first.kill_group()
    start_worker(concurrency=1)
    applied(key)
    assert_killed_execution_told(key, pid)


def test_a_sigterm_then_a_sigkill_mid_job_is_counted_with_its_cause(start_worker, redis_client):
    """A deploy that does not wait: SIGTERM (a warm shutdown starts draining the job),
    then SIGKILL of the whole worker before the job ends. Its message comes back to
    another worker; the drained execution died, and is told as such."""
    first = start_worker(concurrency=1)
    key, pid = hold(redis_client, first.queue, seconds=4)
    first.process.send_signal(signal.SIGTERM)
    time.sleep(1)
    first.kill_group()
    start_worker(concurrency=1)
    applied(key)
    assert_killed_execution_told(key, pid)


def test_control_a_holder_stopped_past_its_lease_expired_and_ran_once_more(
    start_worker, redis_client, queue
) -> None:
    """Control: the holder is alive (SIGSTOP) when its lease runs out. The cause is
    lease_expired, and the stale holder wrote its own (fenced) row: nothing is added."""
    for _ in range(2):
        start_worker(concurrency=1)
    order = int(uuid.uuid4().int % 10**8)
    tag = uuid.uuid4().hex[:8]
    Profile.objects.create(user_id=order, data="old address")
    ShipToAddress().apply_async(args=[order, tag], queue=queue)
    stale = int(wait_for(lambda: redis_client.lindex(f"started:{tag}", 0), what="the holder"))
    os.kill(stale, signal.SIGSTOP)
    redis_client.set(f"stopped:{tag}", 1, ex=60)
    try:
        wait_for(lambda: redis_client.llen(f"started:{tag}") == 2, what="the takeover")
    finally:
        os.kill(stale, signal.SIGCONT)
    redis_client.set(f"proceed:{tag}", 1, ex=60)
    key = f"ship:{order}"
    wait_for(lambda: Attempt.objects.filter(idempotency_key=key).count() == 2, what="2 rows")
    assert Fence.objects.get(idempotency_key=key).cause == "lease_expired"
    text = explain(key)
    verdict = verdict_of(text)
    assert "ran 2 times" in verdict, text
    assert "1 lease takeover after the lease expired" in verdict, text
    assert "after its holder died" not in verdict and "no attempt row" not in verdict, text
    [match] = explain_json(key)["matches"]
    assert "execution" not in [e["kind"] for e in match["events"]]
    [fenced] = [e for e in match["events"] if e["data"].get("outcome") == Outcome.FENCED]
    assert "its lease was taken over at" in fenced["text"] and "run out" in fenced["text"]


def conflict(start_worker, queue: str) -> tuple[str, DeadLetter]:  # type: ignore[no-untyped-def]
    """A conflict dead letter beside its applied effect. Its key holds no number (a
    bare number must find it by the letter's id alone)."""
    name, op = f"c{uuid.uuid4().hex[:6]}", f"op{uuid.uuid4().hex[:6]}"
    Counter.objects.create(name=name)
    start_worker()
    Increment().apply_async(kwargs={"name": name, "op_id": op, "amount": 1}, queue=queue)
    wait_for(lambda: Attempt.objects.filter(outcome=Outcome.APPLIED).exists())
    Increment().apply_async(kwargs={"name": name, "op_id": op, "amount": 5}, queue=queue)
    wait_for(lambda: Attempt.objects.filter(outcome=Outcome.CONFLICT).exists())
    key = f"counter:{name}:op:{op}"
    return key, DeadLetter.objects.get(idempotency_key=key)


def test_a_discarded_conflict_stays_in_the_verdict_with_who_and_when(start_worker, queue):
    key, letter = conflict(start_worker, queue)
    before = verdict_of(explain(key))  # control: the same letter, open
    assert f"dead-lettered: 1 conflict (dead letter {letter.pk}, open)" in before, before
    dead_letters.discard(letter, by="alice")
    letter.refresh_from_db()
    text = explain(key)
    verdict = verdict_of(text)
    assert "ran 2 times" in verdict
    when = f"discarded at {times.shown(letter.resolved_at)} by alice"
    assert f"dead-lettered: 1 conflict (dead letter {letter.pk}, {when})" in verdict, verdict
    assert f"dead letter {letter.pk} {when}" in text  # and on the timeline, at that time
    [match] = explain_json(key)["matches"]
    [closed] = [e for e in match["events"] if e["kind"] == "dead_letter_closed"]
    assert closed["data"]["resolved_by"] == "alice"
    assert closed["at"] == times.iso(letter.resolved_at)


def test_a_replayed_letter_says_who_replayed_it_and_what_it_led_to(start_worker, queue):
    payment = int(uuid.uuid4().int % 10**8) + 3 * 10**8
    key = f"payment:{payment}:capture"
    start_worker()
    Declined().apply_async(args=[payment], queue=queue)
    first = wait_for(lambda: DeadLetter.objects.filter(idempotency_key=key).first())
    replay_id = dead_letters.replay(first, by="oncall")
    again = wait_for(lambda: DeadLetter.objects.filter(task_id=replay_id).first())
    first.refresh_from_db()
    verdict = verdict_of(explain(key))
    # The open letter leads the verdict; the replayed one stays, with who and when.
    assert f"waiting for an operator (dead letter {again.pk})" in verdict, verdict
    replayed = f"replayed at {times.shown(first.resolved_at)} by oncall as task {replay_id}"
    assert f"(dead letter {first.pk}, {replayed})" in verdict, verdict
    dead_letters.discard(again, by="alice")
    verdict = verdict_of(explain(key))
    assert "waiting for an operator" not in verdict, verdict
    assert f"discarded at {times.shown(DeadLetter.objects.get(pk=again.pk).resolved_at)}" in (
        verdict
    )
    assert replayed in verdict, verdict


def test_a_bare_number_says_how_each_job_matched(start_worker, queue) -> None:
    """A number that is a dead letter's id and a business id in another key: both jobs,
    each with its rule. Control: a number that is only a dead letter's id."""
    key, letter = conflict(start_worker, queue)
    Declined().apply_async(args=[letter.pk], queue=queue)
    payment = f"payment:{letter.pk}:capture"
    declined = wait_for(lambda: DeadLetter.objects.filter(idempotency_key=payment).first())
    matches = {m["key"]: m["matched_by"] for m in explain_json(str(letter.pk))["matches"]}
    assert matches == {
        key: f"dead letter id {letter.pk}",
        payment: f"business id {letter.pk} in the key",
    }
    text = explain(str(letter.pk))
    assert f"{key}  (matched as dead letter id {letter.pk})" in text
    assert f"{payment}  (matched as business id {letter.pk} in the key)" in text
    only = explain_json(str(declined.pk))["matches"]
    assert [(m["key"], m["matched_by"]) for m in only] == [
        (payment, f"dead letter id {declined.pk}")
    ]


def test_a_task_id_published_twice_is_named_as_such(start_worker, queue) -> None:
    """The same task id published twice: a second publish, not a second execution of
    one attempt. Control: the redelivered execution of a killed process above is named
    a redelivery, not a second publish."""
    name = f"d{uuid.uuid4().hex[:6]}"
    Counter.objects.create(name=name)
    start_worker(concurrency=1)
    task_id = str(uuid.uuid4())
    for _ in range(2):
        Increment().apply_async(kwargs={"name": name, "op_id": "1"}, queue=queue, task_id=task_id)
    wait_for(lambda: Attempt.objects.filter(task_id=task_id).count() == 2, what="2 attempts")
    text = explain(task_id)
    assert text.count("published again with the same task id") == 1, text
    assert "second execution of the same attempt" not in text
    assert "1 more publish with a task id already run" in verdict_of(text), text
