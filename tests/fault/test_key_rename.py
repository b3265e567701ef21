"""Fault tests: a deploy that renames a task's key template never applies an effect twice.

Version 1 of ``tests.renamed_capture`` keys its effect ``cap:{ref}``; version 2 renames
it ``payment:{ref}:capture`` and adds a parameter with a default. Real workers of each
version, in every direction a rolling deploy mixes them. The negative control turns the
key history off (``EXPLICIT_KEY_HISTORY=0``): the same rounds apply effects twice.
"""

from __future__ import annotations

import uuid

import pytest

from django_outbox.models import Attempt, KeyTemplate, Outcome, ProcessedOperation
from tests.celery_app import app
from tests.support.waiting import wait_for
from tests.testapp.models import Counter

pytestmark = [
    pytest.mark.worker,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(300),
]

TASK = "tests.renamed_capture"
V1 = {"EXPLICIT_TEST_CAPTURE_VERSION": "1"}
V2 = {"EXPLICIT_TEST_CAPTURE_VERSION": "2"}


def publish(
    queue: str, ref: str, key: str, *, task_id: str | None = None, die: bool = False
) -> str:
    """A message as a producer of either version sends it: its key in the headers."""
    task_id = task_id or str(uuid.uuid4())
    app.send_task(
        TASK,
        kwargs={"ref": ref, "die": die},
        queue=queue,
        task_id=task_id,
        headers={"idempotency_key": key},
    )
    return task_id


def attempts(ref: str, n: int) -> list[str]:
    def ended() -> list[str]:
        rows = Attempt.objects.filter(task_name=TASK, idempotency_key__contains=f"{ref}")
        found = sorted(rows.values_list("outcome", flat=True))
        return found if len(found) >= n else []

    return wait_for(ended, timeout=60, what=f"{n} attempts of {ref}")  # type: ignore[no-any-return]


def run_rounds(start_worker, queue: str, switch: str) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Every direction once; the effects each applied (1 = once)."""
    env = {"EXPLICIT_KEY_HISTORY": switch}
    refs = {
        name: f"{name}-{uuid.uuid4().hex[:6]}" for name in ("old-copy", "new-dup", "old-worker")
    }
    for ref in refs.values():
        Counter.objects.create(name=ref)

    # Version 1 runs: it applies two jobs and records its template; the first of them
    # dies after its commit, before the ack (redelivered after the deploy).
    v1 = start_worker(concurrency=1, extra_env={**V1, **env})
    killed = publish(queue, refs["old-copy"], f"cap:{refs['old-copy']}", die=True)
    publish(queue, refs["new-dup"], f"cap:{refs['new-dup']}")
    wait_for(lambda: Counter.objects.get(name=refs["new-dup"]).value == 1, what="v1 applied")
    wait_for(lambda: Counter.objects.get(name=refs["old-copy"]).value == 1, what="v1 applied")
    v1.stop()

    # The deploy: version 2 starts; the killed job's copy (published under the old
    # key) is delivered to it, and a duplicate of the other is published under the new.
    v2 = start_worker(concurrency=1, extra_env={**V2, **env})
    publish(queue, refs["old-copy"], f"cap:{refs['old-copy']}", task_id=killed, die=True)
    publish(queue, refs["new-dup"], f"payment:{refs['new-dup']}:capture")
    # Version 2 applies a job; a worker of version 1 still running gets its duplicate.
    publish(queue, refs["old-worker"], f"payment:{refs['old-worker']}:capture")
    wait_for(lambda: Counter.objects.get(name=refs["old-worker"]).value >= 1, what="v2 applied")
    attempts(refs["old-copy"], 3)
    attempts(refs["new-dup"], 2)
    v2.stop()
    start_worker(concurrency=1, extra_env={**V1, **env})
    publish(queue, refs["old-worker"], f"cap:{refs['old-worker']}")
    attempts(refs["old-worker"], 2)
    return {name: Counter.objects.get(name=ref).value for name, ref in refs.items()}


def test_a_renamed_key_applies_each_effect_once(start_worker, queue) -> None:
    assert run_rounds(start_worker, queue, "1") == {"old-copy": 1, "new-dup": 1, "old-worker": 1}
    # The rename is on record; the redelivered copy's attempt names the key it came with.
    templates = set(KeyTemplate.objects.filter(task_name=TASK).values_list("template", flat=True))
    assert templates == {"cap:{ref}", "payment:{ref}:capture"}
    mismatched = Attempt.objects.exclude(published_key="").filter(outcome=Outcome.ALREADY_APPLIED)
    assert {a.published_key.split(":")[0] for a in mismatched} == {"cap"}, list(mismatched)
    # No conflict from the parameter version 2 added with a default.
    assert not Attempt.objects.filter(outcome=Outcome.CONFLICT).exists()
    # Recorded under both names by the version that applied it.
    keys = set(ProcessedOperation.objects.values_list("key", flat=True))
    assert any(k.startswith("payment:old-worker") for k in keys)
    assert any(k.startswith("cap:old-worker") for k in keys)


def test_negative_control_without_the_key_history(start_worker, queue) -> None:
    applied = run_rounds(start_worker, queue, "0")
    assert applied == {"old-copy": 2, "new-dup": 2, "old-worker": 2}
