"""Fault test: per-entity ordering under several worker processes.

Events for many orders are published in a shuffled interleaving (each order's own
events in sequence) to two workers of two processes each, on each broker; handlers
take random time, and an odd event longer than the even one after it. With
``ordering_key`` every order's events run in publish order and each order ends in its
last event's state; the negative control (no ordering key) runs some orders' events
out of order.
"""

from __future__ import annotations

import random
import uuid

import pytest
from kombu import Connection

from django_outbox.models import Attempt
from tests.support.waiting import wait_for
from tests.testapp.models import OrderState
from tests.testapp.tasks import ApplyOrderEvent, ApplyOrderEventUnordered

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]

ORDERS, EVENTS = 12, 6


def shuffled_interleaving(rng: random.Random) -> list[tuple[int, int]]:
    """Every (order, seq), each order's seqs ascending, orders interleaved at random."""
    pending = {order: list(range(1, EVENTS + 1)) for order in range(ORDERS)}
    out = []
    while pending:
        order = rng.choice(sorted(pending))
        out.append((order, pending[order].pop(0)))
        if not pending[order]:
            del pending[order]
    return out


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "negative-control"])
def test_each_entity_ends_in_its_last_event(
    start_worker, redis_client, queue, broker, ordered
) -> None:
    task = ApplyOrderEvent() if ordered else ApplyOrderEventUnordered()
    start_worker(concurrency=2, extra_env={"EXPLICIT_TEST_BROKER_URL": broker})
    start_worker(concurrency=2, extra_env={"EXPLICIT_TEST_BROKER_URL": broker})
    tag = uuid.uuid4().hex[:8]
    # Order ids of this run's own: an entity's ordering state lives in Redis for days,
    # and a run stopped halfway would leave the next run's entities waiting out the gap.
    base = uuid.uuid4().int % 10**7 * 100
    with Connection(broker) as conn:
        for order, seq in shuffled_interleaving(random.Random(7)):
            task.apply_async(
                kwargs={"order_id": base + order, "seq": seq, "tag": tag},
                queue=queue,
                connection=conn,
            )
    # The handler notes a run in Redis just after its effect (and attempt row) commit:
    # wait for both, or the last note of an entity may still be on its way.
    wait_for(
        lambda: (
            Attempt.objects.filter(task_name=task.name).count() >= ORDERS * EVENTS
            and sum(redis_client.llen(f"applied:{tag}:{base + order}") for order in range(ORDERS))
            == ORDERS * EVENTS
        ),
        timeout=90,
        what="every event applied and noted",
    )
    final = dict(OrderState.objects.values_list("order_id", "status"))
    wrong = {order: status for order, status in final.items() if status != str(EVENTS)}
    runs = {
        order: [int(s) for s in redis_client.lrange(f"applied:{tag}:{base + order}", 0, -1)]
        for order in range(ORDERS)
    }
    out_of_order = [order for order, seqs in runs.items() if seqs != sorted(seqs)]
    if ordered:
        assert wrong == {} and out_of_order == []
        assert all(seqs == list(range(1, EVENTS + 1)) for seqs in runs.values())
    else:
        assert out_of_order, "the control should run some events out of order"
        assert len(final) == ORDERS
