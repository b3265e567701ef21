"""Cancellation that holds while workers are offline: stored as data, checked at start
and at the effect's commit.

Celery's ``revoke`` is a broadcast: a worker that is down or restarts does not hear it.
Here a cancellation is a row in the database (``django_outbox.Cancellation``: who, when,
why, by task id or by idempotency key), written by ``manage.py explicit_cancel`` or the
admin, and a mark in the state store for the job path's cheap look. A task opts in:

    class ShipOrder(ExplicitTask):
        cancellable = True

What a cancellable job does:

- **Before it starts** (this step): a cancelled job ends ``cancelled``, with no effect,
  nothing retried or dead-lettered. One Redis round trip (two ``EXISTS``, the task
  id's mark and the key's) per delivery of a cancellable task; none for a task that
  did not declare it. Without Redis the job runs, and the commit check below holds.
- **While it runs**: ``self.cancelled`` is True once the mark is there, read at most
  once every quarter of the task's lease (the heartbeat's period), so a handler can stop
  early. Nothing forces it to: the commit check is the guarantee.
- **At its effect's commit**: ``effect()`` reads the cancellation rows in the effect's
  own transaction, after a shared advisory lock on the job's task id and key that the
  cancel takes exclusively, and refuses to commit (``JobCancelled``, outcome
  ``cancelled``). The lock orders the two: a cancel acknowledged before the commit
  started refuses it, and a commit that started first makes the cancel report "already
  applied". So no effect happens after a cancel is acknowledged, whatever Redis holds.

Cancellation cannot undo an effect that committed: the command says so and shows the
ledger entry.

State in Redis (``EXPLICIT_REDIS_URL``): ``{prefix}cancelled:{<task id>}`` and
``{prefix}cancelled-key:{<key>}``, each ``<by>|<at>``, for ``MARK_TTL``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery_explicit import job_log, metrics, redis_state
from celery_explicit.outcomes import Outcome
from celery_explicit.redis_scripts import tagged
from celery_explicit.redis_state import text
from celery_explicit.steps import RUN, Decision, Drop, Job, Step

if TYPE_CHECKING:
    from collections.abc import Callable

    from celery_explicit.contract import Contract

__all__ = ["CancellationStep", "Watch", "declared", "mark", "mark_keys", "marked"]

logger = job_log.get_logger("celery_explicit.cancellation")

#: How long a mark stays: a job published with a long countdown, or waiting in a queue
#: while every worker is down, must still find it. The database row stays until pruned.
MARK_TTL = 30 * 86400


def declared(cls: type, refuse: Callable[[str, str], Exception]) -> bool:
    """``cancellable``: True or False (the default), nothing else."""
    value = getattr(cls, "cancellable", False)
    if not isinstance(value, bool):
        raise refuse(f"cancellable={value!r} must be True or False", "cancellable")
    return value


def mark_keys(task_id: str, key: str, *, prefix: str | None = None) -> list[str]:
    """The job's two marks: by its task id, by its idempotency key."""
    head = prefix or redis_state.prefix()
    return [f"{head}cancelled:{tagged(task_id)}", f"{head}cancelled-key:{tagged(key)}"]


def mark(task_id: str, key: str, by: str, *, client: Any | None = None) -> None:
    """Set the marks a cancel writes after its row committed (either may be "")."""
    conn = client or redis_state.client()
    value = f"{by}|{time.time():.3f}"
    by_id, by_key = mark_keys(task_id, key)
    pipe = conn.pipeline(transaction=False)
    if task_id:
        pipe.set(by_id, value, ex=MARK_TTL)
    if key:
        pipe.set(by_key, value, ex=MARK_TTL)
    pipe.execute()


def marked(task_id: str, key: str, *, client: Any | None = None) -> str | None:
    """Who cancelled this job (``<by>|<at>``), or None. One round trip."""
    conn = client or redis_state.client()
    pipe = conn.pipeline(transaction=False)
    for name in mark_keys(task_id, key):
        pipe.get(name)
    found = [value for value in pipe.execute() if value is not None]
    return text(found[0]) if found else None


def who(value: str) -> str:
    """``alice`` from a mark's ``alice|1764724800.123``."""
    return value.rsplit("|", 1)[0]


class CancellationStep(Step):
    """A cancelled job is not run. Its failure policy: without Redis it runs, and its
    effect's commit is refused by the database's rows."""

    name = "cancellation"

    @classmethod
    def declared(cls, contract: Contract) -> CancellationStep | None:
        return cls(contract.task_name) if contract.cancellable else None

    def before_run(self, job: Job) -> Decision:
        import redis

        execution = job.execution
        try:
            found = marked(execution.task_id, execution.key)
        except redis.RedisError:
            logger.warning(
                "cancellation marks unavailable: running; the commit is still checked",
                extra=execution.log_fields(),
            )
            return RUN
        if found is None:
            return RUN
        metrics.cancelled.labels(self.task_name, "before_start").inc()
        return Drop(Outcome.CANCELLED, f"cancelled by {who(found)} before it started")


@dataclass
class Watch:
    """``self.cancelled`` for one execution: the mark, read at most every ``period``."""

    task_id: str
    key: str
    period: float
    _next: float = 0.0
    _seen: bool = False

    def cancelled(self) -> bool:
        import redis

        if self._seen:
            return True
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.period
        try:
            self._seen = marked(self.task_id, self.key) is not None
        except redis.RedisError:
            return False  # unknown: the commit check decides
        return self._seen
