"""Reconciliation's decision that a queue has moved past a message, on figures given here
(the real brokers and a real worker: tests/integration/test_reconcile_rabbitmq.py).

On RabbitMQ (no per-message records) a queue that holds nothing ready may still have
the job prefetched in a worker: it counts as past only when nothing in it is
unacknowledged either. On Redis the lease record answers per message, and the
unacknowledged count is not looked at."""

from __future__ import annotations

import io
import json
import time
import urllib.request
from typing import Any

import pytest
from django.test import override_settings
from kombu import Connection

from django_outbox import broker_queues
from django_outbox.outbox.relay.reconcile import CLOCK_MARGIN, Head, _head, _queue_is_past

SENT = 1_700_000_000.0


def test_on_rabbitmq_an_empty_queue_with_messages_held_by_workers_has_not_moved_past() -> None:
    assert not _queue_is_past(Head(0, None, unacked=3, reported_ready=0), SENT, records=False)
    # The management API's figures not read: the queue alone decides (as without the
    # API), rather than holding every lost job back for good.
    assert _queue_is_past(Head(0, None, unacked=None), SENT, records=False)
    assert not _queue_is_past(Head(2, None, unacked=None), SENT, records=False)
    # Nothing ready, nothing held: past.
    assert _queue_is_past(Head(0, None, unacked=0, reported_ready=0), SENT, records=False)


def test_on_rabbitmq_a_message_ready_in_the_older_figures_may_have_gone_to_a_worker() -> None:
    # The declare finds the queue empty; the management API, a few seconds behind it,
    # still counts a message ready and none held: delivered since, in neither count.
    assert not _queue_is_past(Head(0, None, unacked=0, reported_ready=1), SENT, records=False)


def test_on_redis_held_messages_are_not_looked_at_the_lease_records_answer() -> None:
    # A busy Redis queue always has unacknowledged messages: looking at them would hold
    # back every republish for as long as the load lasts.
    assert _queue_is_past(Head(0, None, unacked=40), SENT, records=True)
    assert _queue_is_past(Head(0, None, unacked=None), SENT, records=True)


def test_the_head_counts_as_after_the_message_only_a_clock_margin_later() -> None:
    held_by_none = {"unacked": 0, "reported_ready": 1}
    for records in (True, False):
        just_after = Head(1, SENT + CLOCK_MARGIN / 2, **held_by_none)
        well_after = Head(1, SENT + CLOCK_MARGIN * 2, **held_by_none)
        before = Head(1, SENT - 60, **held_by_none)
        assert not _queue_is_past(just_after, SENT, records=records)
        assert _queue_is_past(well_after, SENT, records=records)
        assert not _queue_is_past(before, SENT, records=records)
        # Unreadable head or an unknown send time: taken to still hold it.
        assert not _queue_is_past(Head(1, None, **held_by_none), SENT, records=records)
        assert not _queue_is_past(well_after, None, records=records)


def test_on_rabbitmq_workers_holding_messages_outweigh_a_newer_head() -> None:
    assert not _queue_is_past(Head(1, SENT + 60, unacked=2, reported_ready=1), SENT, records=False)


def test_the_head_is_its_senders_stamp() -> None:
    state = broker_queues.QueueState("q", depth=2, oldest_age=30.0, unacked=1, reported_ready=2)
    head = _head(state)
    assert head.oldest_sent is not None and abs(head.oldest_sent - (time.time() - 30.0)) < 1
    assert (head.depth, head.unacked, head.reported_ready) == (2, 1, 2)
    empty = _head(broker_queues.QueueState("q", depth=0, oldest_age=0.0, unacked=0))
    assert (empty.depth, empty.oldest_sent) == (0, None)


@pytest.fixture
def answer(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    figures: dict[str, Any] = {}

    def urlopen(request: urllib.request.Request, timeout: float) -> Any:
        return io.BytesIO(json.dumps(figures).encode())

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    return figures


def test_rabbitmqs_reported_ready_messages_are_kept_beside_the_declares(
    answer: dict[str, Any],
) -> None:
    conn = Connection("amqp://guest:guest@127.0.0.1//")
    answer.update(messages_ready=4, messages_unacknowledged=0)
    with override_settings(EXPLICIT_RABBITMQ_MANAGEMENT_URL=""):
        state = broker_queues._rabbitmq_state(conn, "celery", 0)
    assert (state.depth, state.unacked, state.reported_ready) == (0, 0, 4)
    answer.clear()
    with override_settings(EXPLICIT_RABBITMQ_MANAGEMENT_URL=""):
        unreported = broker_queues._rabbitmq_state(conn, "celery", 0)
    assert unreported.reported_ready is None
