"""Recording dead letters: the evidence of a failure is kept as it came, never lost.

A letter an operator resolved stays resolved when the message fails again; NUL bytes
(which PostgreSQL text refuses) are kept visible instead of costing the letter.
"""

from __future__ import annotations

import pytest
from django.utils import timezone

from django_outbox import dead_letters
from django_outbox.models import DeadLetter, DeadLetterReason, DeadLetterStatus
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
