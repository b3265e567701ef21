"""Per-entity ordering state against real Redis: numbers, turns, give-backs, the gap."""

from __future__ import annotations

import time
import uuid

import pytest

from celery_explicit import ordering
from celery_explicit.errors import BadInput
from tests.testapp.tasks import ApplyOrderEvent


@pytest.fixture
def key() -> str:
    return f"order:{uuid.uuid4().hex[:10]}"


# Long enough that two calls meant to fall inside it still do on a loaded machine (at
# 0.2 s, a stall between two back-to-back calls could make the second one skip ahead).
GAP = 1.0


def test_jobs_take_turns_in_publish_order(redis_client, key) -> None:
    first, second, third = (ordering.take_number(key, client=redis_client) for _ in range(3))
    assert (first, second, third) == (1, 2, 3)
    assert not ordering.turn(key, 2, "t2", gap=60, lease=5, client=redis_client).run
    assert not ordering.turn(key, 3, "t3", gap=60, lease=5, client=redis_client).run
    assert ordering.turn(key, 1, "t1", gap=60, lease=5, client=redis_client).run
    assert ordering.done(key, 1, client=redis_client)
    assert not ordering.done(key, 1, client=redis_client)  # a second end moves nothing
    assert ordering.turn(key, 2, "t2", gap=60, lease=5, client=redis_client).run
    assert not ordering.turn(key, 3, "t3", gap=60, lease=5, client=redis_client).run
    assert ordering.position(key, client=redis_client) == (3, 2)


def test_a_number_given_back_is_not_waited_for(redis_client, key) -> None:
    for _ in range(3):
        ordering.take_number(key, client=redis_client)
    ordering.give_back(key, 2, client=redis_client)  # its publish failed
    assert ordering.turn(key, 1, "t1", gap=60, lease=5, client=redis_client).run
    ordering.done(key, 1, client=redis_client)
    turn = ordering.turn(key, 3, "t3", gap=60, lease=5, client=redis_client)
    assert turn.run and not turn.skipped_ahead and turn.next_seq == 3


def test_a_job_that_never_comes_is_skipped_after_the_gap(redis_client, key) -> None:
    for _ in range(2):
        ordering.take_number(key, client=redis_client)
    # The clock starts:
    assert not ordering.turn(key, 2, "t2", gap=GAP, lease=5, client=redis_client).run
    assert not ordering.turn(key, 2, "t2", gap=GAP, lease=5, client=redis_client).run
    time.sleep(GAP + 0.3)
    turn = ordering.turn(key, 2, "t2", gap=GAP, lease=5, client=redis_client)
    assert turn.run and turn.skipped_ahead and turn.next_seq == 1
    # The straggler still runs (its writes must carry a version), out of turn.
    assert ordering.turn(key, 1, "t1", gap=GAP, lease=5, client=redis_client).run


def test_a_live_job_ahead_is_never_skipped(redis_client, key) -> None:
    for _ in range(2):
        ordering.take_number(key, client=redis_client)
    head = f"job-{uuid.uuid4().hex[:8]}"
    # The head gets the turn: it is alive for its lease (5 s) unless extended.
    assert ordering.turn(key, 1, head, gap=GAP, lease=5, client=redis_client).run
    for _ in range(12):  # longer than the gap, while the head is alive
        assert not ordering.turn(key, 2, "t2", gap=GAP, lease=5, client=redis_client).run
        time.sleep(0.1)
    assert ordering.release_alive(key, head, client=redis_client)


@pytest.mark.django_db
def test_publish_numbers_jobs_and_refuses_a_key_it_cannot_render(redis_client, queue) -> None:
    order_id = int(uuid.uuid4().int % 10**9)
    task = ApplyOrderEvent()
    with pytest.raises(BadInput, match=r"tests\.apply_order_event"):
        task.apply_async(kwargs={"seq": 1, "tag": "x"}, queue=queue)  # no order_id
    task.apply_async(kwargs={"order_id": order_id, "seq": 1, "tag": "x"}, queue=queue)
    task.apply_async(kwargs={"order_id": order_id, "seq": 2, "tag": "x"}, queue=queue)
    assert ordering.position(f"order:{order_id}", client=redis_client) == (2, 1)
    redis_client.delete(queue)


@pytest.mark.django_db
def test_a_failed_publish_gives_its_number_back(redis_client, queue) -> None:
    from kombu import Connection

    order_id = int(uuid.uuid4().int % 10**9)
    task = ApplyOrderEvent()
    with Connection("redis://127.0.0.1:1/0") as dead, pytest.raises(Exception):  # noqa: B017
        task.apply_async(
            kwargs={"order_id": order_id, "seq": 1, "tag": "x"},
            queue=queue,
            connection=dead,
            retry=False,
        )
    task.apply_async(kwargs={"order_id": order_id, "seq": 2, "tag": "x"}, queue=queue)
    # Job 2 does not wait for job 1, which was never published.
    assert ordering.turn(f"order:{order_id}", 2, "t2", gap=60, lease=5, client=redis_client).run
    redis_client.delete(queue)


def test_a_job_that_skipped_ahead_is_not_skipped_while_it_runs(redis_client, key) -> None:
    for _ in range(3):
        ordering.take_number(key, client=redis_client)
    assert not ordering.turn(key, 2, "t2", gap=GAP, lease=5, client=redis_client).run
    time.sleep(GAP + 0.3)
    job = f"job-{uuid.uuid4().hex[:8]}"
    assert ordering.turn(key, 2, job, gap=GAP, lease=5, client=redis_client).skipped_ahead
    for _ in range(12):  # longer than the gap: job 2 is alive, job 3 waits
        assert not ordering.turn(key, 3, "t3", gap=GAP, lease=5, client=redis_client).run
        time.sleep(0.1)
    assert ordering.release_alive(key, job, client=redis_client)
    # Gone without passing its turn (not alive any more): after the gap, job 3 goes ahead.
    assert not ordering.turn(key, 3, "t3", gap=GAP, lease=5, client=redis_client).run
    time.sleep(GAP + 0.3)
    assert ordering.turn(key, 3, "t3", gap=GAP, lease=5, client=redis_client).skipped_ahead


def test_a_job_that_ends_before_its_turn_gives_its_number_back(redis_client, key) -> None:
    for _ in range(3):
        ordering.take_number(key, client=redis_client)
    # Job 2 is dead-lettered (bad input, delivery limit) before job 1 ran.
    assert not ordering.done(key, 2, client=redis_client)
    assert ordering.turn(key, 1, "t1", gap=60, lease=5, client=redis_client).run
    assert ordering.done(key, 1, client=redis_client)
    turn = ordering.turn(key, 3, "t3", gap=60, lease=5, client=redis_client)
    assert turn.run and not turn.skipped_ahead and turn.next_seq == 3


def test_numbers_taken_in_a_block_are_recorded_for_giving_back(redis_client, key) -> None:
    with ordering.record_numbers() as taken:
        first = ordering.take_number(key, client=redis_client)
        second = ordering.take_number(key, client=redis_client)
    assert taken == [(key, first), (key, second)]
    ordering.take_number(key, client=redis_client)  # outside: not recorded
    assert len(taken) == 2
    for number in taken:  # the relay's batch was thrown away
        ordering.give_back(*number, client=redis_client)
    turn = ordering.turn(key, 3, "t3", gap=60, lease=5, client=redis_client)
    assert turn.run and turn.next_seq == 3


def test_a_head_whose_lease_ran_out_is_skipped_after_the_gap(redis_client, key) -> None:
    """A job that got its turn and then died (nobody extends its lease) stops being
    alive when its lease runs out; the job behind it then waits only the gap."""
    for _ in range(2):
        ordering.take_number(key, client=redis_client)
    assert ordering.turn(key, 1, "dead", gap=GAP, lease=0.3, client=redis_client).run
    assert not ordering.turn(key, 2, "t2", gap=GAP, lease=5, client=redis_client).run
    time.sleep(0.4)  # the lease ran out: the gap clock starts at the next look
    assert not ordering.turn(key, 2, "t2", gap=GAP, lease=5, client=redis_client).run
    time.sleep(GAP + 0.3)
    assert ordering.turn(key, 2, "t2", gap=GAP, lease=5, client=redis_client).skipped_ahead


def test_passing_the_turn_ends_the_holders_liveness(redis_client, key) -> None:
    ordering.take_number(key, client=redis_client)
    assert ordering.turn(key, 1, "t1", gap=GAP, lease=60, client=redis_client).run
    assert redis_client.exists(ordering._keys(key)["alive"])
    assert ordering.done(key, 1, task_id="t1", client=redis_client)
    assert not redis_client.exists(ordering._keys(key)["alive"])
