"""Publishing the running job again: a retry after an error, or a deferral.

Both keep the job's task id, key, correlation id and place in its entity's order, and
both hand the execution lease back first, so the next message finds it free. A job
whose lease was taken over meanwhile is not published again: a newer execution owns
it, and a second live copy would run it twice.

A retry leaves an attempt row saying when its next message is due; a deferral leaves
none (it uses no attempt). So that the relay's reconciliation
(``django_outbox.outbox.relay.reconcile``) does not take a job deferred for longer than
``EXPLICIT_OUTBOX_RECONCILE_AFTER`` for a lost one, a deferral of a job the outbox
published leaves a marker in the state store, ``{prefix}deferred:{<task_id>}`` (hash
tag: the task id, as the execution lease's keys), holding when its next message is due
(epoch ms) and expiring ``RECONCILE_AFTER`` after that, both on the Redis server's
clock. That margin is the allowance reconciliation gives a retry's next message before
it takes it for lost (an attempt's ``next_attempt_at``): a deferred job is taken for
lost exactly as late as a retried one (the workers read the setting the relay reads,
from the same Django settings). Reconciliation reads the marker with ``deferral_key``;
a live one means in flight. One script call on the deferral path, none on the normal
one, and none at all for a job published otherwise or with reconciliation off (the
relay reconciles only outbox events).
"""

from __future__ import annotations

from typing import Any, NoReturn

from celery.exceptions import Ignore, Reject, Retry

from celery_explicit import execution_lease_step, job_log, ordering, redis_state
from celery_explicit.conf import settings
from celery_explicit.execution import Execution, delivery, redelivered, running
from celery_explicit.headers import (
    CORRELATION_HEADER,
    DEFERRALS_HEADER,
    FENCE_FREE_LEASE_HEADER,
    KEY_HEADER,
    PUBLISHED_VIA_HEADER,
    REDELIVERED_HEADER,
    REPLAY_HEADER,
)
from celery_explicit.redis_scripts import SERVER_NOW_MS, Script, call, tagged

logger = job_log.get_logger("celery_explicit")

#: apply_async option marking a re-publish (popped before Celery sees it): its
#: arguments were bound and its key rendered when it started, so nothing is checked
#: again, and nothing may fail, or Celery would drop the message.
OPTION = "_explicit_retry"

# KEYS[1] - the job's deferral marker
# ARGV[1] - the deferral's delay in milliseconds
# ARGV[2] - milliseconds the marker outlives its next message's due time
# Both the due time and the expiry are on the server's clock: the relay that reads the
# marker and the worker that writes it may disagree on the time, the server cannot.
# return the due time (epoch ms, the server's clock)
MARK_DEFERRED = Script(
    "republish_mark_deferred",
    SERVER_NOW_MS
    + """
local delay_ms = tonumber(ARGV[1])
local due_ms = now_ms + delay_ms
redis.call('set', KEYS[1], string.format('%.0f', due_ms), 'PX', delay_ms + tonumber(ARGV[2]))
return due_ms
""",
)


def deferral_key(task_id: str, *, prefix: str | None = None) -> str:
    """The job's deferral marker: present while a deferral's next message may still
    come (its value: when it is due, epoch ms on the Redis server's clock)."""
    return f"{prefix or redis_state.prefix()}deferred:{tagged(task_id)}"


def carry_headers(request: Any, headers: dict[str, Any]) -> None:
    """The running job's own headers, for its re-publish."""
    execution = running(request)
    if execution is not None:
        headers[KEY_HEADER] = execution.key
        headers.setdefault(CORRELATION_HEADER, execution.correlation_id)
    for header in (PUBLISHED_VIA_HEADER, DEFERRALS_HEADER):
        value = getattr(request, header, None)
        if value:
            headers.setdefault(header, value)
    replay = getattr(request, REPLAY_HEADER, None)
    if replay is not None:
        # An operator's replay stays one: its dedup id is not a duplicate.
        headers.setdefault(REPLAY_HEADER, replay)
    place = ordering.place_of(request)
    if place is not None:
        # Its place in its entity's order does not change when it runs again.
        headers.update(ordering.place_headers(place))


def retry(task: Any, exc: Exception, countdown: float) -> Retry:
    """``task.retry`` that cannot lose the message.

    Celery turns a failed re-publish into ``Reject(requeue=False)``: the message
    would be dropped. Requeue it instead (it runs again at once rather than after its
    backoff, but it is not lost).
    """
    if not execution_lease_step.hand_back(running(task.request)):
        raise _end_without_republishing(task, "retry")
    try:
        published: Retry = task.retry(exc=exc, countdown=countdown, **{OPTION: True})
    except Reject as reject:
        if getattr(reject, "requeue", False):
            raise
        logger.error(
            "retry could not be published; requeueing the message",
            extra={"task": task.name, "job_id": task.request.id},
        )
        raise Reject(getattr(reject, "reason", None), requeue=True) from exc
    return published


def defer(
    task: Any,
    execution: Execution,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    delay: float,
    *,
    by: str,
) -> NoReturn:
    """Publish the same job again ``delay`` seconds from now and end this delivery.

    Same task id and retry count, no attempt used; the pool slot is free at once. The
    message counts its deferrals by step (``by``), so the attempt that finally runs
    records them: a count in a header, not a row per deferral.
    """
    request = task.request
    deferrals = dict(getattr(request, DEFERRALS_HEADER, None) or {})
    deferrals[by] = int(deferrals.get(by, 0)) + 1
    headers: dict[str, Any] = {**execution.deferral_headers, DEFERRALS_HEADER: deferrals}
    if redelivered(request):
        headers[REDELIVERED_HEADER] = True
    if getattr(request, FENCE_FREE_LEASE_HEADER, False):
        headers[FENCE_FREE_LEASE_HEADER] = True  # still a copy beside an earlier one
    if not execution_lease_step.hand_back(execution):
        raise _end_without_republishing(task, "deferral")
    if getattr(request, PUBLISHED_VIA_HEADER, None) == "outbox":
        _mark_deferred(execution, delay)
    try:
        task.apply_async(
            args,
            kwargs,
            task_id=execution.task_id,
            countdown=delay,
            retries=int(request.retries or 0),
            queue=delivery(request, "routing_key"),
            headers=headers,
            **{OPTION: True},
        )
    except Exception as exc:
        raise Reject(exc, requeue=True) from exc
    raise Ignore()


def _mark_deferred(execution: Execution, delay: float) -> None:
    """Leave the deferral's marker for the relay's reconciliation (module docstring).

    Written before the publish: a marker whose message was not published (the publish
    failed, the message is requeued) only says "alive" of a job that is. Without the
    state store the deferral goes on unmarked: reconciliation may then publish a copy,
    which the job's idempotency key absorbs."""
    import redis

    margin = settings.outbox_reconcile_after
    if margin <= 0:
        return  # reconciliation is off: nothing reads it
    try:
        call(
            redis_state.client(),
            MARK_DEFERRED,
            [deferral_key(execution.task_id)],
            [max(0, int(delay * 1000)), max(1, int(margin * 1000))],
        )
    except redis.RedisError:
        logger.warning(
            "could not mark the deferral for reconciliation (its job may be published "
            "again if it stays deferred past EXPLICIT_OUTBOX_RECONCILE_AFTER)",
            extra=execution.log_fields(),
        )


def _end_without_republishing(task: Any, what: str) -> Ignore:
    """The lease was lost: leave the job to the execution that took it over."""
    job_id = task.request.id
    logger.warning(
        "%s not published: a newer execution of job %s took its lease over",
        what,
        job_id,
        extra={"task": task.name, "job_id": job_id},
    )
    return Ignore()
