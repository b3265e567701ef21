"""Explicit dedup: drop a second message that carries an id already seen, for a while.

Dedup is not idempotency. Dedup drops a second *message* carrying a known message or
event id inside a window, to spare the work of an upstream resend; idempotency makes a
second *execution* of the same effect harmless, forever, and is what guarantees the
effect happens once (a message outside the window, or one that dedup never saw, is
still stopped by the effect ledger).

A task declares ``dedup_key = "{event_id}"`` (a template over ``run()``'s parameters,
or a callable) and ``dedup_window`` (seconds). The first message to claim an id owns
it for the window: a later message with the same id is dropped at publish (nothing is
sent; the caller gets the owner's result handle) or, if it reached the broker another
way, at delivery (recorded as an attempt with outcome ``deduplicated``). Retries and
redeliveries keep their task id, so they are never dropped; replays from the dead
letters skip dedup.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery_explicit import declarations, job_log, keys, metrics, redis_state
from celery_explicit.headers import REPLAY_HEADER
from celery_explicit.outcomes import Outcome
from celery_explicit.redis_scripts import CLAIM_IF_FREE, RELEASE_IF_MINE, call
from celery_explicit.redis_state import client, text
from celery_explicit.steps import RUN, Decision, Drop, Job, RetryLater, Step

if TYPE_CHECKING:
    from celery_explicit.contract import Contract

logger = job_log.get_logger("celery_explicit.dedup")
_rng = random.SystemRandom()


@dataclass(frozen=True)
class Dedup:
    key: keys.KeyDeclaration
    window: float


def declared(
    cls: type, params: tuple[str, ...], takes_kwargs: bool, refuse: declarations.Refuse
) -> Dedup | None:
    found = declarations.key_with_duration(
        cls,
        params,
        takes_kwargs,
        refuse,
        key_attr="dedup_key",
        duration_attr="dedup_window",
        example="'{event_id}'",
        without_key="declare the message id to deduplicate on, e.g. dedup_key='{event_id}'",
    )
    if found is None:
        return None
    key, window = found
    if window is None:
        raise refuse(
            "dedup_key is declared without dedup_window: say how long (seconds) "
            "a second message with the same id is dropped",
            "dedup_window",
        )
    return Dedup(key=key, window=window)


CLAIM = CLAIM_IF_FREE  # the first to ask holds it
RELEASE = RELEASE_IF_MINE


def mark_key(task_name: str, dedup_id: str, *, prefix: str | None = None) -> str:
    return f"{prefix or redis_state.prefix()}dedup:{task_name}:{dedup_id}"


def claim(
    task_name: str, dedup_id: str, task_id: str, *, window: float, redis_client: Any | None = None
) -> str:
    """Claim ``dedup_id`` for ``task_id``; return the task id that owns it."""
    conn = redis_client or client()
    window_ms = max(1, int(window * 1000))
    owner = call(conn, CLAIM, [mark_key(task_name, dedup_id)], [task_id, window_ms])
    return text(owner)


def release(
    task_name: str, dedup_id: str, task_id: str, *, redis_client: Any | None = None
) -> bool:
    """Give back a claim whose message was never published (compare-and-delete)."""
    conn = redis_client or client()
    return bool(call(conn, RELEASE, [mark_key(task_name, dedup_id)], [task_id]))


def claim_at_publish(
    task_name: str,
    key: keys.KeyDeclaration,
    given: dict[str, Any],
    task_id: str,
    *,
    window: float,
) -> tuple[str, str]:
    """Publish side: ``(owner, dedup_id)``; the message is dropped unless ``owner`` is
    ``task_id`` (nothing is sent; the caller gets the owner's result handle)."""
    dedup_id = keys.render_key(task_name, key, given, label="dedup key")
    owner = claim(task_name, dedup_id, task_id, window=window)
    if owner != task_id:
        metrics.dedup_dropped.labels(task_name, "publish").inc()
        logger.info(
            "dedup: message dropped at publish",
            extra={"task": task_name, "dedup_id": dedup_id, "job_id": owner, "layer": "delivery"},
        )
    return owner, dedup_id


class DedupStep(Step):
    """Delivery side: a message whose dedup id another message owns is dropped here."""

    name = "dedup"

    def __init__(self, task_name: str, window: float) -> None:
        super().__init__(task_name)
        self.window = window

    @classmethod
    def declared(cls, contract: Contract) -> DedupStep | None:
        if contract.dedup is None:
            return None
        return cls(contract.task_name, contract.dedup.window)

    def before_run(self, job: Job) -> Decision:
        import redis

        if getattr(job.request, REPLAY_HEADER, None) is not None:
            return RUN  # an operator's replay is deliberate
        execution = job.execution
        dedup_id = execution.dedup_id
        try:
            owner = claim(self.task_name, dedup_id, execution.task_id, window=self.window)
        except redis.RedisError as exc:
            # Cannot tell whether it is a duplicate: keep the message, try again later.
            return RetryLater(exc, _rng.uniform(1.0, 5.0))
        if owner == execution.task_id:
            return RUN
        metrics.dedup_dropped.labels(self.task_name, "delivery").inc()
        return Drop(Outcome.DEDUPLICATED, f"dedup id {dedup_id!r} is owned by job {owner}")
