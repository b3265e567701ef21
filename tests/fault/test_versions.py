"""Fault test: events for one entity applied in shuffled order.

Every entity gets versions 1..5 in a random order (fixed seed, so the history is
reproducible). With versioned_update each entity ends on version 5's status and late
events are refused; the negative control (a plain update) leaves entities on whatever
arrived last, which shows the check can fail.
"""

from __future__ import annotations

import random
from collections import Counter as Tally

import pytest

from celery_explicit.errors import StaleVersion
from django_outbox.store.guarded_writes import versioned_update
from tests.testapp.models import OrderState

pytestmark = pytest.mark.django_db

ENTITIES, VERSIONS = 20, 5
STATUS = {1: "created", 2: "paid", 3: "packed", 4: "shipped", 5: "delivered"}


def history() -> list[tuple[int, int]]:
    events = [(order, v) for order in range(ENTITIES) for v in range(1, VERSIONS + 1)]
    random.Random(20261129).shuffle(events)
    return events


@pytest.mark.parametrize("guarded", [True, False], ids=["versioned", "negative-control"])
def test_each_entity_ends_on_its_last_event(guarded: bool) -> None:
    OrderState.objects.bulk_create(OrderState(order_id=i) for i in range(ENTITIES))
    outcomes: Tally[str] = Tally()
    for order, version in history():
        rows = OrderState.objects.filter(order_id=order)
        if not guarded:
            rows.update(status=STATUS[version], version=version)
            outcomes["applied"] += 1
            continue
        try:
            versioned_update(rows, version=version, status=STATUS[version])
            outcomes["applied"] += 1
        except StaleVersion:
            outcomes["refused as stale"] += 1
    final = Tally(OrderState.objects.values_list("status", flat=True))
    if guarded:
        assert final == Tally({"delivered": ENTITIES})
        assert outcomes["refused as stale"] > 0
        assert sum(outcomes.values()) == ENTITIES * VERSIONS
    else:
        assert final["delivered"] < ENTITIES  # an older event won somewhere


def test_a_duplicate_event_is_a_no_op_and_an_older_one_is_refused() -> None:
    OrderState.objects.create(order_id=99)
    rows = OrderState.objects.filter(order_id=99)
    assert versioned_update(rows, version=3, status="packed") == 1
    assert versioned_update(rows, version=3, status="packed") == 0
    with pytest.raises(StaleVersion, match="version 2 is older than the stored 3"):
        versioned_update(rows, version=2, status="paid")
    assert rows.get().status == "packed"
