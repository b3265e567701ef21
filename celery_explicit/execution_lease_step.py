"""The execution lease on the job path: taken before the handler runs, given back after.

Step 4 of the pipeline (``celery_explicit.pipeline``). Before the handler runs it takes
the job's execution lease (``celery_explicit.execution_lease``: the scripts, the keys and
the fencing token), and answers from what it found:

- held by a live execution: defer this delivery, re-published for a moment before the
  holder's lease could run out, so no pool slot waits on it;
- free: run, with the lease's fence on the execution; on a redelivery, write that
  fence to the database first (an earlier execution's lease record may have been lost
  in a Redis failover, and its commit must be refused as a takeover's is);
- taken over from a holder that never released it: write the takeover to the database
  first (the ``Fence`` row that refuses the stale holder's commit), and run; without
  the database, retry rather than run a job whose stale holder could still commit.

After the handler, and before a retry or a deferral publishes the job again
(``hand_back``), the lease is given back, so the next message finds it free; a lease
found taken over meanwhile marks the execution ``lost_lease``.

Kept apart from the lease so that the lease (read by the worker's heartbeat, the relay's
reconciliation and the operator's listings) does not import the job path's steps.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from django.db import Error as DatabaseError

from celery_explicit import job_log, metrics, store
from celery_explicit.execution import Execution, delivery
from celery_explicit.execution import redelivered as execution_redelivered
from celery_explicit.execution_lease import Held, Released, Taken, acquire, enabled, release
from celery_explicit.headers import FENCE_FREE_LEASE_HEADER
from celery_explicit.steps import RUN, Decision, Defer, Ending, Job, RetryLater, Step

if TYPE_CHECKING:
    from celery_explicit.contract import Contract

logger = job_log.get_logger("celery_explicit.execution_lease_step")

_rng = random.SystemRandom()


class ExecutionLeaseStep(Step):
    """Hold the job's execution lease while the handler runs, or defer this delivery.

    Its failure policy: without Redis the job runs, unfenced, loudly (the lease is a
    safety net for a rare race); without the database a takeover is not run (the
    stale holder could still commit), it is retried.
    """

    name = "execution_lease"

    def __init__(self, task_name: str, ttl: float) -> None:
        super().__init__(task_name)
        self.ttl = ttl

    @classmethod
    def declared(cls, contract: Contract) -> ExecutionLeaseStep:
        return cls(contract.task_name, contract.visibility_timeout)

    def before_run(self, job: Job) -> Decision:
        import redis

        execution = job.execution
        redelivered = bool(delivery(job.request, "redelivered"))
        # A deferred copy of a redelivery, or one the reconciler published again.
        again = execution_redelivered(job.request) or bool(
            getattr(job.request, FENCE_FREE_LEASE_HEADER, False)
        )
        if not enabled():
            if redelivered:
                metrics.redeliveries.labels(self.task_name, "broker").inc()
            return RUN
        try:
            lease = acquire(execution.task_id, ttl=self.ttl)
        except redis.RedisError:
            logger.warning(
                "execution lease unavailable: running unfenced", extra=execution.log_fields()
            )
            return RUN
        if isinstance(lease, Held):
            metrics.concurrent_executions_deferred.labels(self.task_name).inc()
            # Look again well before the holder's lease could run out: it may end soon.
            quarter = max(0.5, self.ttl * 0.25)
            return Defer(
                min(lease.retry_in, quarter) + _rng.uniform(0.2, 1.0),
                f"another execution of this job is running ({lease.holder})",
                {"holder": lease.holder},
            )
        execution.fence = lease.fence
        if lease.took_over_from:
            return self._take_over(execution, lease)
        if redelivered:
            metrics.redeliveries.labels(self.task_name, "broker").inc()
        if again:
            return self._fence_unleased(execution)
        return RUN

    def _take_over(self, execution: Execution, lease: Taken) -> Decision:
        metrics.redeliveries.labels(self.task_name, lease.cause).inc()
        logger.info(
            "took over the execution lease of %s (%s); fence %s",
            lease.took_over_from,
            lease.cause,
            lease.fence,
            extra={**execution.log_fields(), "layer": "delivery", "fence": lease.fence},
        )
        try:
            store.get().record_takeover(
                execution.task_id,
                execution.key,
                lease.fence,
                lease.took_over_from,
                cause=lease.cause.value if lease.cause else "",
                holder_started_ms=lease.holder_started_ms,
            )
        except DatabaseError as exc:
            # Without the fence row the stale holder could still commit: do not run.
            # Keep the lease (it runs out by itself) rather than release it: releasing
            # would erase the "not released" marker, and the retry would then take a
            # fresh lease with no takeover to record.
            execution.fence = None
            return RetryLater(exc, _rng.uniform(1.0, 5.0), record=False)
        return RUN

    def _fence_unleased(self, execution: Execution) -> Decision:
        """A redelivered job whose lease was free: fence it all the same.

        Free most often means no earlier execution started (the message was prefetched
        when its worker died) or one released and died before its ack. It also means
        a Redis failover that lost the lease's keys while an earlier execution still
        runs: nothing in Redis says it was taken over, so the database must, or that
        execution's commit would land. One statement per redelivery, never on a first
        delivery; without the database the job is retried, as a takeover is.
        """
        assert execution.fence is not None
        try:
            store.get().record_fence(execution.task_id, execution.key, execution.fence)
        except DatabaseError as exc:
            # Keep the lease (it runs out by itself), as a takeover does: released, the
            # retry would find it free again with nothing to say it must fence, and an
            # earlier execution whose record was lost could still commit. Kept, the
            # retry finds it not released and takes it over, writing the fence then.
            execution.fence = None
            return RetryLater(exc, _rng.uniform(1.0, 5.0), record=False)
        return RUN

    def after_run(
        self, request: Any, execution: Execution | None, ending: Ending, *, entered: bool
    ) -> None:
        if execution is not None and execution.fence is not None:
            give_back(execution)


def give_back(execution: Execution) -> None:
    """Release the lease; a lease found taken over marks the execution ``lost_lease``."""
    import redis

    assert execution.fence is not None
    try:
        released = release(execution.task_id, execution.fence)
    except redis.RedisError:
        logger.warning(
            "could not release the execution lease (it runs out by itself)",
            extra=execution.log_fields(),
        )
        return
    if released is Released.GONE:
        released = _gone(execution)
    if not released:
        # Taken over while this execution ran (it was paused past its lease): the
        # job is the newer execution's now, its turn included.
        execution.lost_lease = True


def _gone(execution: Execution) -> Released:
    """The lease's record was not there at the release: taken over by an execution that
    has ended since (its fence row is newer than ours), or lost in a Redis failover
    (no newer fence: the job is still this execution's, and a retry must be published,
    or the job would be lost with it)."""
    assert execution.fence is not None
    try:
        newer = store.get().newer_fence(execution.task_id, execution.fence)
    except DatabaseError:
        # Unknown: publishing a retry costs at most a run the ledger absorbs; not
        # publishing it could lose the job.
        newer = None
    if newer is not None:
        logger.warning(
            "execution lease of job %s (fence %s) was taken over (fence %s) before it ended",
            execution.task_id,
            execution.fence,
            newer,
            extra=execution.log_fields(),
        )
        return Released.TAKEN_OVER
    logger.warning(
        "execution lease of job %s (fence %s) was gone at its release, with no newer "
        "fence: its record was lost (a Redis failover); the job stays this execution's",
        execution.task_id,
        execution.fence,
        extra=execution.log_fields(),
    )
    return Released.GONE


def hand_back(execution: Execution | None) -> bool:
    """Before re-publishing this job: its next message must find the lease free.

    False when the lease had been taken over meanwhile: another execution owns the
    job now, and this one must not publish a second live copy of it.
    """
    if execution is not None and execution.fence is not None:
        give_back(execution)
        execution.fence = None
        return not execution.lost_lease
    return True
