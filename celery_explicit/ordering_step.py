"""Per-entity ordering on the job path: a job runs on its turn, and passes it on at its end.

Step 3 of the pipeline (``celery_explicit.pipeline``). Before the handler runs it asks
for the job's turn in its entity's order (``celery_explicit.ordering``: the numbers, the
turn and the gap, in Redis) and answers from what it found:

- the job's turn (or already past it, a late copy): run;
- a missing job ahead waited out for ``ordering_gap``: run, logged and counted;
- an earlier job's turn: defer, re-published in a moment, never holding a pool slot;
- no number in its headers (published before ``ordering_key`` was declared, or by
  ``send_task``), or Redis unavailable: run, out of turn.

At its end the job passes the turn on if it ended for good; a retry or a deferral keeps
its place but stops counting as alive, so a next attempt that never comes is skipped
after the gap.

Kept apart from the order so that the order (read by the publisher, the relay and the
worker's heartbeat) does not import the job path's steps.
"""

from __future__ import annotations

import contextlib
import random
from typing import TYPE_CHECKING, Any

from celery_explicit import job_log, metrics
from celery_explicit.execution import Execution
from celery_explicit.ordering import pass_turn_on, place_of, release_alive, turn
from celery_explicit.steps import RUN, Decision, Defer, Ending, Job, Step

if TYPE_CHECKING:
    from celery_explicit.contract import Contract

logger = job_log.get_logger("celery_explicit.ordering_step")
_rng = random.SystemRandom()


class OrderingStep(Step):
    """Run only when every earlier job of this entity has ended; defer otherwise.

    The turn passes on when the job ends for good, whichever step ended it (a dead
    letter, a dedup drop, bad input): not on a retry or a deferral, and not when a
    newer execution took the job over (the turn is that one's to pass).
    """

    name = "ordering"

    def __init__(self, task_name: str, gap: float, lease: float) -> None:
        super().__init__(task_name)
        self.gap, self.lease = gap, lease

    @classmethod
    def declared(cls, contract: Contract) -> OrderingStep | None:
        if contract.ordering is None:
            return None
        return cls(contract.task_name, contract.ordering.gap, contract.visibility_timeout)

    def before_run(self, job: Job) -> Decision:
        import redis

        place = place_of(job.request)
        if place is None:
            # Published without a number (before ordering_key was declared, or by
            # send_task): it has no place to wait for.
            return RUN
        key, seq = place
        fields = job.execution.log_fields()
        try:
            now = turn(key, seq, job.execution.task_id, gap=self.gap, lease=self.lease)
        except redis.RedisError:
            logger.warning("ordering of %s unavailable: running out of turn", key, extra=fields)
            return RUN
        if now.skipped_ahead:
            metrics.ordering_skipped.labels(self.task_name).inc()
            logger.warning(
                "ordering %s: jobs %s..%s never came within %.0fs; job %s goes ahead",
                key,
                now.next_seq,
                seq - 1,
                self.gap,
                seq,
                extra=fields,
            )
        if now.run:
            return RUN
        metrics.ordering_deferred.labels(self.task_name).inc()
        return Defer(
            _rng.uniform(0.2, 1.0),
            f"{key} job {seq} waits for job {now.next_seq}",
            {"ordering_key": key},
        )

    def after_run(
        self, request: Any, execution: Execution | None, ending: Ending, *, entered: bool
    ) -> None:
        import redis

        place = place_of(request)
        if execution is not None and execution.lost_lease:
            return  # the newer execution holds the turn now
        if not ending.goes_on:
            pass_turn_on(place, task=self.task_name, job_id=request.id)
        elif entered and place is not None:
            # Not over (a retry, a deferral by a later step): it stops counting as
            # alive, so a next attempt that never comes is skipped after the gap.
            # Without Redis it expires with the lease instead.
            with contextlib.suppress(redis.RedisError):
                release_alive(place[0], str(request.id))
