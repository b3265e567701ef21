"""The ledger's floor: the shortest ledger retention that cannot reopen a duplicate.

A ledger entry is what stops a second copy of a job from applying its effect again.
Deleted while a copy can still arrive, it lets that copy through: a duplicate effect.
How late a copy can arrive after the effect committed is bounded by what the
configuration allows, and the delays chain (a copy republished by the reconciler at
its horizon can be redelivered by the broker's backstop, retried through its whole
schedule, and deferred by a database outage on the way), so the floor is their sum:

- the broker's backstop: Redis's ``visibility_timeout`` (a worker that died between
  its commit and its ack has its message redelivered that late) plus kombu's restore
  sweep; RabbitMQ's ``consumer_timeout``; on another broker the longest task lease;
- the longest retry schedule of a registered ExplicitTask: the ceilings of its
  ``max_attempts - 1`` backoff delays (``celery_explicit.retry_policy``) and as many
  runs, each bounded by ``max_run_time`` or else by its lease;
- reconciliation's horizon (when reconciliation is on): the relay republishes an event
  without a trace up to that long after its publish;
- the database outage backoff cap (when that deferral is on): a deferred copy comes
  back that long after the database does.

A dedup window is not a delay but a promise (a resend inside it is dropped at the
door), and the ledger must keep it at least as long: the floor is the longest dedup
window where that is longer than the sum. ``manage.py check`` reports a ledger
retention below the floor (E020) and ``explicit_prune`` refuses to prune the ledger
then (``LedgerBelowFloor``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery_explicit import retry_policy
from django_outbox.checks import broker
from django_outbox.checks.reading import loaded_tasks
from django_outbox.conf import settings
from django_outbox.retention.periods import human, setting_name

__all__ = [
    "Floor",
    "LedgerBelowFloor",
    "Term",
    "ledger_floor",
    "refuse_below_floor",
    "retry_schedule",
]


@dataclass(frozen=True)
class Term:
    """One delay of the floor, and what set it."""

    seconds: float
    what: str


@dataclass(frozen=True)
class Floor:
    """The shortest ledger retention that still outlives every late copy of a job."""

    terms: tuple[Term, ...]

    @property
    def seconds(self) -> float:
        return sum(term.seconds for term in self.terms)

    def describe(self) -> str:
        return " + ".join(f"{term.what} ({human(term.seconds)})" for term in self.terms)


class LedgerBelowFloor(ValueError):
    """``EXPLICIT_RETAIN_LEDGER`` is shorter than the floor: pruning would reopen
    duplicates. Carries the retention and the floor."""

    def __init__(self, seconds: float, floor: Floor) -> None:
        self.seconds, self.floor = seconds, floor
        super().__init__(
            f"{setting_name('ledger')}={seconds:g}s ({human(seconds)}) is shorter than the "
            f"ledger's floor of {floor.seconds:g}s ({human(floor.seconds)}): a copy of a job "
            f"can still arrive that late, and would find its ledger entry gone and apply its "
            f"effect again. The floor is {floor.describe()}"
        )


def refuse_below_floor(seconds: float) -> None:
    floor = ledger_floor()
    if seconds < floor.seconds:
        raise LedgerBelowFloor(seconds, floor)


def ledger_floor(app: Any = None, tasks: Sequence[Any] | None = None) -> Floor:
    """The floor of the ledger's retention for ``app`` (default: the configured Celery
    app) and its ExplicitTasks (default: all of them, task modules imported)."""
    app = app if app is not None else settings.celery_app()
    tasks = list(tasks) if tasks is not None else loaded_tasks(app)
    chain = [_backstop(app, tasks)]
    longest = max(tasks, key=lambda task: retry_schedule(task.contract), default=None)
    if longest is not None:
        chain.append(
            Term(
                retry_schedule(longest.contract),
                f"the retry schedule of task {longest.name} (max_attempts="
                f"{longest.contract.retry.max_attempts}, backoff_cap="
                f"{longest.contract.retry.backoff_cap:g}s, and its runs)",
            )
        )
    if settings.outbox_reconcile_after > 0:
        chain.append(Term(settings.outbox_reconcile_horizon, "EXPLICIT_OUTBOX_RECONCILE_HORIZON"))
    if settings.database_outage:
        chain.append(
            Term(settings.database_outage_backoff_cap, "EXPLICIT_DATABASE_OUTAGE_BACKOFF_CAP")
        )
    floor = Floor(tuple(term for term in chain if term.seconds > 0))
    deduped = [t for t in tasks if t.contract.dedup is not None]
    widest = max(deduped, key=lambda t: t.contract.dedup.window, default=None)
    if widest is not None and widest.contract.dedup.window > floor.seconds:
        return Floor((Term(widest.contract.dedup.window, f"dedup_window of task {widest.name}"),))
    return floor


def retry_schedule(contract: Any) -> float:
    """From a job's first try to its last: the ceilings of its backoff delays and the
    runs before them, each bounded by ``max_run_time`` or else by its lease."""
    policy = contract.retry
    retries = max(0, policy.max_attempts - 1)
    run = contract.max_run_time or contract.visibility_timeout
    delays = sum(
        retry_policy.backoff_ceiling(n, base=policy.backoff_base, cap=policy.backoff_cap)
        for n in range(1, retries + 1)
    )
    return float(delays + retries * run)


def _backstop(app: Any, tasks: Sequence[Any]) -> Term:
    url = str(app.conf.broker_url or "")
    if url.startswith(broker.REDIS_URL_SCHEMES):
        options = app.conf.broker_transport_options or {}
        timeout = float(options.get("visibility_timeout", broker.REDIS_DEFAULT_VISIBILITY_TIMEOUT))
        sweep = broker.redis_sweep(options)
        return Term(
            timeout + sweep,
            f"the Redis broker's visibility_timeout ({timeout:g}s) and restore sweep "
            f"({sweep:g}s) in broker_transport_options",
        )
    if url.startswith(broker.RABBITMQ_URL_SCHEMES) and settings.rabbitmq_consumer_timeout:
        return Term(settings.rabbitmq_consumer_timeout, "EXPLICIT_RABBITMQ_CONSUMER_TIMEOUT")
    longest = max(tasks, key=lambda task: task.contract.visibility_timeout, default=None)
    if longest is None:
        return Term(0.0, "no task lease")
    return Term(
        longest.contract.visibility_timeout, f"the visibility_timeout of task {longest.name}"
    )
