"""Delivery limit: a message delivered too many times goes to the dead letters.

Celery counts retries, not deliveries. A message whose handler kills its worker (out of
memory, a segfault in a C extension) is requeued on worker loss
(``reject_on_worker_lost``) and delivered again, forever, taking a worker down each
time (celery#9082). Each redelivered ExplicitTask message (the broker flags it) is
counted before the handler runs; past ``max_deliveries`` (default 5, the first
delivery included) it is dead-lettered with reason ``delivery_limit`` instead of being
run again. First deliveries are not counted, so the common path costs nothing.

The count is per message: task id and retry number (a retry is a new message). It
lives in Redis (``EXPLICIT_REDIS_URL``) as ``{prefix}redeliveries:{task_id}:{retries}``.
A delivery whose handler ran and ended (the message did not take its worker down)
deletes it, so a finished job leaves no count behind; a count whose worker died with it
expires a day after the last delivery, which is how a poison message is remembered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery_explicit import job_log, redis_state
from celery_explicit.errors import DeliveryLimitExceeded
from celery_explicit.execution import Execution, delivery
from celery_explicit.steps import RUN, DeadLetter, Decision, Ending, Job, Step

if TYPE_CHECKING:
    from celery_explicit.contract import Contract

logger = job_log.get_logger("celery_explicit.delivery_limit")

COUNT_TTL = 24 * 3600


def count_key(task_id: str, retries: int, *, prefix: str | None = None) -> str:
    return f"{prefix or redis_state.prefix()}redeliveries:{task_id}:{retries}"


def count_delivery(task_id: str, retries: int, *, redis_client: Any | None = None) -> int:
    """Add this redelivery to the message's count; return the count including it."""
    conn = redis_client or redis_state.client()
    pipe = conn.pipeline()
    key = count_key(task_id, retries)
    pipe.incr(key)
    pipe.expire(key, COUNT_TTL)
    count, _ = pipe.execute()
    return int(count)


class DeliveryLimitStep(Step):
    """First: a message that keeps coming back is dead-lettered before anything else.

    Only redeliveries are counted (the broker flags them): a first delivery costs no
    round trip, and the count plus the first delivery is the total.
    """

    name = "delivery_limit"

    def __init__(self, task_name: str, max_deliveries: int) -> None:
        super().__init__(task_name)
        self.max_deliveries = max_deliveries

    @classmethod
    def declared(cls, contract: Contract) -> DeliveryLimitStep:
        return cls(contract.task_name, contract.max_deliveries)

    def before_run(self, job: Job) -> Decision:
        import redis

        request = job.request
        if not delivery(request, "redelivered"):
            return RUN
        try:
            redeliveries = count_delivery(job.execution.task_id, int(request.retries or 0))
        except redis.RedisError:
            # Counting is a safety net: without Redis the job still runs.
            logger.warning("could not count a delivery", extra=job.execution.log_fields())
            return RUN
        deliveries = redeliveries + 1
        job.execution.deliveries = deliveries
        job_log.update(deliveries=deliveries)
        if deliveries <= self.max_deliveries:
            return RUN
        error = DeliveryLimitExceeded(
            self.task_name, deliveries=deliveries, limit=self.max_deliveries
        )
        return DeadLetter(error, "DELIVERY_LIMIT")

    def after_run(
        self, request: Any, execution: Execution | None, ending: Ending, *, entered: bool
    ) -> None:
        import redis

        # Only a counted redelivery has a key; a job that goes on (a retry, a deferral,
        # a requeue) may be delivered again under the same count.
        if not entered or execution is None or execution.deliveries <= 1 or ending.goes_on:
            return
        try:
            redis_state.client().delete(
                count_key(execution.task_id, int(getattr(request, "retries", 0) or 0))
            )
        except redis.RedisError:
            # The count expires by itself (COUNT_TTL).
            logger.warning("could not delete a delivery count", extra=execution.log_fields())
