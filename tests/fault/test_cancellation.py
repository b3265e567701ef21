"""Fault tests: a cancellation holds while every worker is down, and refuses the commit
of a job cancelled while it runs, with real workers.

- Every worker down: jobs are published, then cancelled by key (``explicit_cancel
  --key``); a worker starts afterwards. Each job ends ``cancelled`` and no effect
  happens. Negative control: Celery's ``revoke`` of the same jobs while no worker
  listens: the worker that starts runs them all.
- During the handler: the job has started and waits; it is cancelled, then let go. Its
  handler sees ``self.cancelled`` and its effect's commit is refused (``cancelled``, no
  effect). Negative control: the same task without ``cancellable = True`` applies its
  effect although the cancellation row is there.
"""

from __future__ import annotations

import io
import uuid

import pytest
from django.core.management import call_command

from django_outbox.models import Attempt, Cancellation, Outcome
from tests.support.scale import scaled
from tests.support.waiting import wait_for
from tests.testapp.models import OrderState
from tests.testapp.tasks import CancellableShip, ShipNotCancellable

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]

JOBS = scaled(3, 20)


def cancel(*args: str) -> str:
    out = io.StringIO()
    call_command("explicit_cancel", *args, "--by", "oncall", stdout=out)
    return out.getvalue()


def outcomes_of(keys: list[str]) -> dict[str, str]:
    return dict(
        Attempt.objects.filter(idempotency_key__in=keys).values_list("idempotency_key", "outcome")
    )


@pytest.mark.parametrize("how", ["explicit_cancel", "celery_revoke"], ids=["cancel", "control"])
def test_a_cancel_holds_while_every_worker_is_down(start_worker, queue: str, how: str) -> None:
    from tests.celery_app import app

    base = 10_000 + int(uuid.uuid4().int % 1_000_000) * 100
    orders = [base + i for i in range(JOBS)]
    keys = [f"cship:{order}" for order in orders]
    ids = [
        CancellableShip().apply_async(kwargs={"order_id": order}, queue=queue).id
        for order in orders
    ]
    for key, task_id in zip(keys, ids, strict=True):
        if how == "explicit_cancel":
            assert cancel("--key", key).startswith(f"cancelled key {key}")
        else:
            app.control.revoke(task_id)  # a broadcast no worker hears
    start_worker(concurrency=2)
    wait_for(lambda: len(outcomes_of(keys)) == JOBS, timeout=60, what="every job's attempt")
    shipped = OrderState.objects.filter(order_id__in=orders).count()
    if how == "explicit_cancel":
        assert set(outcomes_of(keys).values()) == {Outcome.CANCELLED}
        assert shipped == 0
        assert Cancellation.objects.filter(idempotency_key__in=keys).count() == JOBS
    else:
        assert set(outcomes_of(keys).values()) == {Outcome.APPLIED}
        assert shipped == JOBS  # Celery's revoke did not hold


@pytest.mark.parametrize(
    ("task", "expected"),
    [(CancellableShip, Outcome.CANCELLED), (ShipNotCancellable, Outcome.APPLIED)],
    ids=["cancellable", "control"],
)
def test_a_cancel_during_the_handler_refuses_the_commit(
    start_worker, redis_client, queue: str, task: type, expected: str
) -> None:
    start_worker(concurrency=1)
    order = 20_000 + int(uuid.uuid4().int % 1_000_000)
    tag = uuid.uuid4().hex[:8]
    key = f"{'cship' if task is CancellableShip else 'ncship'}:{order}"
    task().apply_async(kwargs={"order_id": order, "tag": tag}, queue=queue)
    wait_for(lambda: redis_client.llen(f"started:{tag}") == 1, timeout=30, what="the start")
    assert cancel("--key", key).startswith(f"cancelled key {key}")
    redis_client.set(f"proceed:{tag}", 1, ex=60)
    wait_for(lambda: outcomes_of([key]), timeout=30, what="the attempt")
    assert outcomes_of([key]) == {key: expected}
    shipped = OrderState.objects.filter(order_id=order).exists()
    if expected == Outcome.CANCELLED:
        assert not shipped
        assert redis_client.get(f"saw-cancelled:{tag}") == b"1"
        attempt = Attempt.objects.get(idempotency_key=key)
        assert "cancelled by oncall" in attempt.error_message
    else:
        assert shipped
