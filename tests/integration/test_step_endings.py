"""The end of a delivery, on real Redis: each step ends its part in its own ``try``.

A step whose ``after_run`` raises (here the downstream's, which runs before the
execution lease's) is logged once and the lease is still released; the negative
control runs the same steps through a loop that does not isolate them and finds the
lease still held.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Collection, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from celery_explicit import Downstream, ExplicitTask, downstream, execution_lease, pipeline
from celery_explicit.execution import Execution
from celery_explicit.steps import RUN, Ending, Job, Step


class UnexpectedReply(Exception):
    """Not a Redis error: what a step does not expect, so does not catch."""


def define(name: str) -> type[ExplicitTask]:
    def run(self: Any, order_id: int) -> None:
        return None

    body: dict[str, Any] = {
        "name": name,
        "idempotency_key": "order:{order_id}",
        "visibility_timeout": 30,
        "expected_duration": 1,
        "retry_on": (),
        "fail_on": (),
        "downstream": Downstream(f"ending-{uuid.uuid4().hex[:8]}", concurrency=2),
        "run": run,
    }
    return type("ShipOrder", (ExplicitTask,), body)


@pytest.fixture
def entered_job(redis_client: redis.Redis) -> Iterator[tuple[type[ExplicitTask], Job, set[str]]]:
    """A task whose job went through every step: the lease and a downstream slot held."""
    task = define(f"tests.ending_{uuid.uuid4().hex[:8]}")
    task_id = f"job-{uuid.uuid4().hex[:10]}"
    execution = Execution(
        task_id=task_id,
        task_name=task.name,
        key="order:1",
        fingerprint="f",
        attempt=1,
        started_at=dt.datetime.now(dt.UTC),
        correlation_id="",
    )
    request = SimpleNamespace(id=task_id, retries=0, delivery_info={}, headers={})
    job = Job(task_name=task.name, request=request, execution=execution)
    entered: set[str] = set()
    for step in task.job_steps:
        assert step.before_run(job) is RUN, step.name
        entered.add(step.name)
    assert execution.fence is not None
    assert redis_client.exists(execution_lease.lease_key(task_id))
    yield task, job, entered
    redis_client.delete(
        execution_lease.lease_key(task_id),
        execution_lease.marker_key(task_id),
        execution_lease.fence_key(task_id),
    )
    redis_client.delete(*downstream.keys(task.contract.downstream.name))  # type: ignore[union-attr]


def not_isolated(
    task_name: str,
    steps: Sequence[Step],
    request: Any,
    execution: Execution | None,
    ending: Ending,
    entered: Collection[str],
) -> None:
    """The end as it was: one loop, so the first error skips every step after it."""
    for step in reversed(steps):
        step.after_run(request, execution, ending, entered=step.name in entered)


def broken_leave(*args: Any, **kwargs: Any) -> Any:
    raise UnexpectedReply("downstream leave: reply not understood")


def test_a_step_failing_at_the_end_still_lets_the_lease_go(
    entered_job: Any, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    task, job, entered = entered_job
    assert [s.name for s in task.job_steps][-2:] == ["execution_lease", "downstream"]
    monkeypatch.setattr(downstream, "leave", broken_leave)
    with caplog.at_level(logging.ERROR, logger="celery_explicit"):
        pipeline.end(
            task.name, task.job_steps, job.request, job.execution, Ending(goes_on=False), entered
        )
    assert not redis_client.exists(execution_lease.lease_key(job.execution.task_id))
    assert not job.execution.lost_lease
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.step == "downstream"  # type: ignore[attr-defined]
    assert record.job_id == job.execution.task_id  # type: ignore[attr-defined]
    assert record.task == task.name  # type: ignore[attr-defined]
    assert record.exc_info is not None and record.exc_info[0] is UnexpectedReply


def test_negative_control_without_isolation_the_lease_stays_held(
    entered_job: Any, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    task, job, entered = entered_job
    monkeypatch.setattr(downstream, "leave", broken_leave)
    with pytest.raises(UnexpectedReply):
        not_isolated(
            task.name, task.job_steps, job.request, job.execution, Ending(goes_on=False), entered
        )
    assert redis_client.exists(execution_lease.lease_key(job.execution.task_id))
