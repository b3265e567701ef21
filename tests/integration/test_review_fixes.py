"""Failure paths found in review: each must leave evidence, never lose a message."""

from __future__ import annotations

import uuid

import pytest
from django.db import transaction
from django.db.transaction import TransactionManagementError
from django.test import override_settings
from django.utils import timezone
from kombu import Connection

from django_outbox import dead_letters, ledger
from django_outbox.models import (
    Attempt,
    DeadLetter,
    DeadLetterReason,
    DeadLetterStatus,
    Outcome,
    ProcessedOperation,
)
from tests.testapp.models import Counter
from tests.testapp.tasks import Declined, NestedEffect, RecordEvent
from tests.workers import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("round_trips", [True, False])
def test_an_effect_marked_for_rollback_does_not_commit_and_says_so(round_trips: bool) -> None:
    Counter.objects.create(name="nr")
    with override_settings(EXPLICIT_LEDGER_ROUND_TRIPS=round_trips), pytest.raises(
        TransactionManagementError, match="rolled back: a database error inside"
    ), ledger.effect(key="nr", fingerprint="f", task_name="t", task_id="i"):
        Counter.objects.filter(name="nr").update(value=1)
        transaction.set_rollback(True)  # what a caught error inside atomic() leaves behind
    assert Counter.objects.get(name="nr").value == 0
    assert not ProcessedOperation.objects.filter(key="nr").exists()


def test_a_failed_publish_gives_its_dedup_claim_back(redis_client, queue) -> None:
    event = uuid.uuid4().hex
    dead_broker = Connection("redis://127.0.0.1:1/0", connect_timeout=0.2)
    with pytest.raises(Exception):  # noqa: B017 - whatever the transport raises
        RecordEvent().apply_async(args=[event, "x"], queue=queue, connection=dead_broker,
                                  retry=False)
    RecordEvent().apply_async(args=[event, "x"], queue=queue)
    assert redis_client.llen(queue) == 1  # not dropped in favour of the lost message


def test_a_redelivered_failure_does_not_reopen_a_resolved_letter() -> None:
    letter = dead_letters.record(task_id="t-1", task_name="x", reason=DeadLetterReason.PERMANENT)
    dead_letters.discard(letter, by="op")
    again = dead_letters.record(task_id="t-1", task_name="x", reason=DeadLetterReason.PERMANENT,
                                attempts=2)
    assert again.status == DeadLetterStatus.DISCARDED
    assert again.attempts == 2


def test_nul_characters_are_kept_visible_not_a_reason_to_lose_the_letter() -> None:
    letter = dead_letters.record(task_id="t-nul", task_name="x", reason=DeadLetterReason.BAD_INPUT,
                                 kwargs={"name": "a\x00b"}, raw_body="\x00\x01",
                                 error_message="bad \x00 byte")
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


@pytest.mark.worker
def test_an_effect_inside_the_handlers_own_atomic_is_recorded_once_it_is_known(
        start_worker, queue) -> None:
    Counter.objects.bulk_create([Counter(name="ok"), Counter(name="bad")])
    start_worker()
    NestedEffect().apply_async(args=["ok", False], queue=queue)
    NestedEffect().apply_async(args=["bad", True], queue=queue)
    wait_for(lambda: Attempt.objects.count() == 2, what="both attempts")
    assert dict(Attempt.objects.values_list("idempotency_key", "outcome")) == {
        "nested:ok": Outcome.APPLIED, "nested:bad": Outcome.FAILED_PERMANENT}
    assert Counter.objects.get(name="ok").value == 1
    assert Counter.objects.get(name="bad").value == 0  # the outer rollback took the effect
    assert list(ProcessedOperation.objects.values_list("key", flat=True)) == ["nested:ok"]
