"""Recording dead letters: the evidence of a failure is kept as it came, never lost.

A letter an operator resolved stays resolved when the message fails again; NUL bytes
(which PostgreSQL text refuses) are kept visible instead of costing the letter.
"""

from __future__ import annotations

import io
import json
import uuid

import pytest
from django.utils import timezone

from django_outbox.models import DeadLetter, DeadLetterReason, DeadLetterStatus
from django_outbox.store import dead_letters
from tests.support.waiting import wait_for
from tests.testapp.tasks import Declined

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_redelivered_failure_does_not_reopen_a_resolved_letter() -> None:
    letter = dead_letters.record(task_id="t-1", task_name="x", reason=DeadLetterReason.PERMANENT)
    dead_letters.discard(letter, by="op")
    again = dead_letters.record(
        task_id="t-1", task_name="x", reason=DeadLetterReason.PERMANENT, attempts=2
    )
    assert again.status == DeadLetterStatus.DISCARDED
    assert again.attempts == 2


def test_another_message_with_the_same_id_gets_its_own_letter() -> None:
    """Two different messages may carry one id (a producer reusing ids; the unexpected
    bodies chaos scenario generates malformed messages with the same id): updating one
    letter would lose the first."""
    first = dead_letters.record(
        task_id=300, task_name="?", reason=DeadLetterReason.BAD_INPUT, raw_body="one"
    )
    second = dead_letters.record(
        task_id=300, task_name="?", reason=DeadLetterReason.UNKNOWN_TASK, raw_body="two"
    )
    again = dead_letters.record(
        task_id=300, task_name="?", reason=DeadLetterReason.BAD_INPUT, raw_body="one", attempts=2
    )
    assert first.task_id == "300" and second.task_id.startswith("300#")
    assert again.pk == first.pk  # the same message again updates its own letter
    assert sorted(DeadLetter.objects.values_list("raw_body", "reason", "attempts")) == [
        ("one", DeadLetterReason.BAD_INPUT, 2),
        ("two", DeadLetterReason.UNKNOWN_TASK, 1),
    ]


def test_explain_finds_every_letter_of_a_reused_id() -> None:
    from django.core.management import call_command

    reused = f"legacy-{uuid.uuid4().hex[:6]}"
    for body in ("one", "two"):
        dead_letters.record(
            task_id=reused, task_name="?", reason=DeadLetterReason.BAD_INPUT, raw_body=body
        )
    out = io.StringIO()
    call_command("explicit_explain", reused, "--json", stdout=out)
    found = json.loads(out.getvalue())["matches"]
    letters = sorted(DeadLetter.objects.values_list("task_id", flat=True))
    assert len(letters) == 2 and letters[0] == reused and letters[1].startswith(f"{reused}#")
    assert sorted(tid for match in found for tid in match["task_ids"]) == letters
    # A longer id that merely starts with this one is another job.
    dead_letters.record(
        task_id=f"{reused}0", task_name="?", reason=DeadLetterReason.BAD_INPUT, raw_body="x"
    )
    out = io.StringIO()
    call_command("explicit_explain", reused, "--json", stdout=out)
    assert len(json.loads(out.getvalue())["matches"]) == 2


def test_nul_characters_are_kept_visible_not_a_reason_to_lose_the_letter() -> None:
    letter = dead_letters.record(
        task_id="t-nul",
        task_name="x",
        reason=DeadLetterReason.BAD_INPUT,
        kwargs={"name": "a\x00b"},
        raw_body="\x00\x01",
        error_message="bad \x00 byte",
    )
    letter.refresh_from_db()
    assert "\\x00" in letter.error_message
    assert letter.raw_body.startswith("\\x00")
    assert "\\x00" in str(letter.kwargs)
    assert letter.first_seen <= timezone.now()


@pytest.mark.worker
def test_permanent_failure_with_nul_in_arguments_is_dead_lettered(start_worker, queue) -> None:
    start_worker()
    Declined().apply_async(args=["pay\x00ment"], queue=queue)
    letter = wait_for(lambda: DeadLetter.objects.first(), what="the dead letter")
    assert letter.reason == DeadLetterReason.PERMANENT
    assert letter.attempts == 1


def test_a_replay_goes_back_through_the_exchange_and_routing_key_it_came_with(
    redis_client,
) -> None:
    """A routing key is a queue's name only on Celery's default routes: a message that
    came through an exchange of its own is replayed through that exchange and key (it
    was replayed to a queue named like the routing key, which nobody consumes)."""
    from django.conf import settings as django_settings
    from django.utils import timezone
    from kombu import Connection, Exchange, Queue

    from django_outbox.models import DeadLetter, DeadLetterReason
    from django_outbox.store import dead_letters

    suffix = uuid.uuid4().hex[:8]
    exchange = Exchange(f"explicit-test-ex-{suffix}", type="direct")
    routing_key = f"shop.orders.{suffix}"
    queue_name = f"explicit-test-orders-{suffix}"
    with Connection(django_settings.REDIS_URL) as conn:
        queue = Queue(queue_name, exchange, routing_key=routing_key, channel=conn.default_channel)
        queue.declare()
        now = timezone.now()
        letter = DeadLetter.objects.create(
            task_id=f"t-{suffix}",
            task_name="tests.increment",
            kwargs={"name": "x", "op_id": "1"},
            idempotency_key="counter:x:op:1",
            reason=DeadLetterReason.PERMANENT,
            first_seen=now,
            last_attempt=now,
            queue=routing_key,
            exchange=exchange.name,
        )
        new_id = dead_letters.replay(letter, by="test")
        message = queue.get(no_ack=True)
        try:
            assert message is not None, "the replay did not reach the queue it came from"
            assert message.headers["id"] == new_id
            assert message.headers["replay_of"] == letter.pk
            assert redis_client.llen(routing_key) == 0  # not to a queue named like the key
        finally:
            queue.delete()
            redis_client.delete(routing_key)


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_a_real_letter_is_replayed_to_where_it_came_from(start_worker, queue) -> None:
    """End to end on Celery's default routes (published to the default exchange, the
    queue's name as routing key): the replay reaches the same worker's queue again."""
    from django_outbox.models import Attempt, DeadLetter, Outcome
    from tests.support.waiting import wait_for
    from tests.testapp.tasks import Declined

    start_worker()
    Declined().apply_async(args=[7], queue=queue)
    wait_for(lambda: Attempt.objects.filter(outcome=Outcome.FAILED_PERMANENT).exists())
    letter = DeadLetter.objects.get()
    assert letter.queue == queue  # the routing key it was delivered with
    dead_letters.replay(letter, by="test")
    wait_for(lambda: Attempt.objects.filter(replay_of=letter.pk).exists(), timeout=30)
