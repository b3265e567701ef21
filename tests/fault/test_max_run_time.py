"""A run longer than the task's max_run_time is stopped and recorded, not extended."""

from __future__ import annotations

import uuid

import pytest

from django_outbox.models import Attempt, DeadLetter, DeadLetterReason, Outcome
from tests.support.waiting import wait_for
from tests.testapp.tasks import OrderedOverrun, Overrun, UnlimitedOverrun

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def test_soft_and_hard_limits_stop_the_run_and_leave_a_dead_letter(start_worker, queue) -> None:
    worker = start_worker(concurrency=2)
    polite = Overrun().apply_async(args=["polite"], queue=queue)
    stubborn = Overrun().apply_async(args=["stubborn", True], queue=queue)
    # A dead letter commits just before its attempt row: wait for the polite one's row.
    wait_for(
        lambda: (
            DeadLetter.objects.count() == 2 and Attempt.objects.filter(task_id=polite.id).exists()
        ),
        timeout=30,
        what="two dead letters",
    )
    letters = {d.task_id: d for d in DeadLetter.objects.all()}
    assert {d.reason for d in letters.values()} == {DeadLetterReason.MAX_RUN_TIME}
    # The polite run raised SoftTimeLimitExceeded and recorded its own attempt.
    assert letters[polite.id].error_class.endswith("SoftTimeLimitExceeded")
    assert list(Attempt.objects.filter(task_id=polite.id).values_list("outcome", flat=True)) == [
        Outcome.MAX_RUN_TIME
    ]
    # The stubborn one was killed by the hard limit; the main process recorded it.
    assert "killed by the hard time limit" in letters[stubborn.id].error_message
    assert letters[stubborn.id].args == ["stubborn", True]
    assert worker.alive()


def test_negative_control_without_a_limit_the_long_run_completes(start_worker, queue) -> None:
    start_worker()
    UnlimitedOverrun().apply_async(args=["free"], queue=queue)
    attempt = wait_for(lambda: Attempt.objects.first(), timeout=30, what="the attempt")
    assert attempt.outcome == Outcome.SUCCEEDED
    assert attempt.duration_ms >= 1900  # it ran past where a 1 s limit would stop it
    assert not DeadLetter.objects.exists()


def test_a_job_killed_by_the_hard_limit_passes_its_entitys_turn(start_worker, queue) -> None:
    # The killed handler never reaches its own finally; the worker's main process
    # dead-letters the job and passes the entity's turn. Without that, the next job
    # would wait out the ordering gap: 2 x 4 s + 60 s here, far past this test's wait.
    entity = uuid.uuid4().hex[:8]
    start_worker(concurrency=2)
    killed = OrderedOverrun().apply_async(args=[entity, "first", True], queue=queue)
    after = OrderedOverrun().apply_async(args=[entity, "second"], queue=queue)
    letter = wait_for(
        lambda: DeadLetter.objects.filter(task_id=killed.id).first(),
        timeout=30,
        what="the killed job's dead letter",
    )
    assert "killed by the hard time limit" in letter.error_message
    ran = wait_for(
        lambda: Attempt.objects.filter(task_id=after.id).first(),
        timeout=20,
        what="the next job of the entity to run",
    )
    assert ran.outcome == Outcome.SUCCEEDED
    # In order: the second job ran only once the first had been killed and recorded.
    assert ran.started_at >= letter.last_attempt
