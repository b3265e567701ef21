"""Prometheus metrics. Each name says which layer it counts: delivery, execution, effect.

One name per concept: the Python name is the metric's name without ``explicit_`` and
``_total`` (``idempotency_conflicts`` is ``explicit_idempotency_conflicts_total``),
and the label values are the words of ``celery_explicit.outcomes``. Labels never carry
an idempotency key, an argument or a payload: only task, queue, lock family,
downstream names and the closed sets of words below (docs/metrics.md lists them all).

With the prefork pool every child counts in its own memory: the worker's endpoint
(``celery_explicit.worker_metrics``, ``EXPLICIT_WORKER_METRICS_PORT``) switches these
metrics to prometheus_client's multiprocess files at worker start, before the pool
forks, and serves the merged view.

Every series lives for the process's life (and, merged, for the worker's), so a label
value must come from a set the code fixes, never from a message: anyone who can
publish could otherwise create series without end. Each metric below checks its
``task`` and ``lock`` labels as they are set, whoever sets them:

- ``task``: a task registered in the Celery app, else ``unknown``. A message for a
  task no worker knows (Celery's ``task_unknown``), or rejected before it ran, names
  its task in its headers: that name is the sender's word.
- ``lock``: the lock's family, the name up to its first ``:``
  (``celery_explicit.locks``); a process keeps the first ``MAX_LOCK_FAMILIES`` it
  sees, later ones count as ``other``. A name without ``:`` is its own family, so a
  lock named per entity without one would otherwise be a series per entity.

The other labels are words of ``celery_explicit.outcomes`` or of this module, queue
names from the worker's own configuration, downstream names from declarations, and
exception class names from the handlers' code.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Self

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from celery_explicit.conf import settings

logger = logging.getLogger("celery_explicit.metrics")

#: The ``task`` label of a name the app has not registered.
UNKNOWN_TASK = "unknown"
#: The ``lock`` label once a process has seen ``MAX_LOCK_FAMILIES`` families.
OTHER_LOCKS = "other"
#: Lock families a process labels by name; an application has a handful.
MAX_LOCK_FAMILIES = 64
#: Label combinations a metric keeps at hand (``_Bounded.labels``); past it, each
#: further one is checked every time, as all were.
MAX_ACCEPTED = 1024


def task_label(name: Any) -> str:
    """``name`` if the Celery app has registered a task by it, else ``unknown``."""
    if isinstance(name, str) and name in settings.celery_app().tasks:
        return name
    return UNKNOWN_TASK


_lock_families: set[str] = set()
_lock_families_mutex = threading.Lock()


def lock_label(family: Any) -> str:
    """``family`` while this process has seen fewer than ``MAX_LOCK_FAMILIES``, else
    ``other`` (said once, naming the first family refused)."""
    name = str(family)
    with _lock_families_mutex:
        if name in _lock_families:
            return name
        if len(_lock_families) < MAX_LOCK_FAMILIES:
            _lock_families.add(name)
            return name
        first_refused = OTHER_LOCKS not in _lock_families
        _lock_families.add(OTHER_LOCKS)
    if first_refused:
        logger.warning(
            "lock metrics: more than %d lock families in this process; lock %r and later "
            "new ones are labelled %r. Name locks <family>:<id> (a name without ':' is its "
            "own family)",
            MAX_LOCK_FAMILIES,
            name,
            OTHER_LOCKS,
        )
    return OTHER_LOCKS


#: The labels whose values are checked as they are set, and how.
BOUNDED_LABELS: dict[str, Callable[[Any], str]] = {"task": task_label, "lock": lock_label}


_ONLY_STR = frozenset({str})


class _Bounded(MetricWrapperBase):
    """A metric whose ``task`` and ``lock`` label values go through ``BOUNDED_LABELS``.

    ``labels()`` is where every value enters a metric (prometheus_client creates each
    series there), so callers cannot forget it."""

    #: Children by the label values they were asked for, when every value was a ``str``
    #: accepted as given. A job asks for four children; checking its task name against
    #: the registry and building the tuple prometheus_client keys by cost about 4 µs a
    #: call, a look-up here 0.2. Only ``str`` values: prometheus_client keys a child by
    #: ``str(value)``, and values equal to each other can print differently (``1`` and
    #: ``True``, a ``(str, Enum)`` member and its value). Safe to keep: an accepted value
    #: stays accepted (tasks are not unregistered, lock families only added), and a
    #: child is the same object for the process's life (``worker_metrics`` re-creates
    #: its values in place). A child is kept only while prometheus_client holds it, and
    #: ``remove``, ``remove_by_labels`` and ``clear`` empty the dict after their change.
    _accepted: dict[tuple[str, ...], Any]

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> Self:
        accepted: dict[tuple[str, ...], Any] | None = None
        # The types checked in C (a generator here cost a job about 70 opcodes).
        if labelvalues and not labelkwargs and {*map(type, labelvalues)} == _ONLY_STR:
            accepted = self.__dict__.get("_accepted")
            if accepted is None:
                accepted = self._accepted = {}
            child = accepted.get(labelvalues)
            if child is not None:
                return child  # type: ignore[no-any-return]
        names = self._labelnames
        if labelkwargs:
            labelkwargs = {n: _bounded(n, v) for n, v in labelkwargs.items()}
            return super().labels(*labelvalues, **labelkwargs)
        if len(labelvalues) != len(names):
            return super().labels(*labelvalues)  # prometheus_client names the mistake
        bounded = tuple(_bounded(n, v) for n, v in zip(names, labelvalues, strict=True))
        made = super().labels(*bounded)
        if accepted is not None and bounded == labelvalues:
            with self._lock:
                # Still the one prometheus_client holds: a clear() meanwhile drops it.
                if self._metrics.get(labelvalues) is made and len(accepted) < MAX_ACCEPTED:
                    accepted[labelvalues] = made
        return made

    def remove(self, *labelvalues: Any) -> None:
        super().remove(*labelvalues)
        self._forget()

    def remove_by_labels(self, labels: dict[str, str]) -> None:
        super().remove_by_labels(labels)
        self._forget()

    def clear(self) -> None:
        super().clear()
        self._forget()

    def _forget(self) -> None:
        accepted = self.__dict__.get("_accepted")
        if accepted:
            with self._lock:
                accepted.clear()


def _bounded(name: str, value: Any) -> Any:
    check = BOUNDED_LABELS.get(name)
    return value if check is None else check(value)


class _Counter(_Bounded, Counter):
    pass


class _Histogram(_Bounded, Histogram):
    pass


class _Gauge(_Bounded, Gauge):
    pass


executions = _Counter(
    "explicit_executions_total",
    "Executions of a handler (execution layer), by how they ended.",
    ["task", "outcome"],
)
effects_applied = _Counter(
    "explicit_effects_applied_total",
    "Effects committed with their ledger row (effect layer).",
    ["task"],
)
idempotency_conflicts = _Counter(
    "explicit_idempotency_conflicts_total",
    "Executions that found their key already in the ledger (effect layer). "
    "kind=duplicate: same arguments, absorbed; kind=arguments: other arguments, "
    "dead-lettered.",
    ["task", "kind"],
)
retries_scheduled = _Counter(
    "explicit_retries_scheduled_total",
    "Retries scheduled after a retryable error (execution layer).",
    ["task", "error_class"],
)
dead_letters = _Counter(
    "explicit_dead_letters_total",
    "Messages dead-lettered, by reason (delivery or execution layer).",
    ["task", "reason"],
)
#: Buckets up to 15 min: a job's p99 must land in a bucket, not in +Inf.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)
attempt_duration_seconds = _Histogram(
    "explicit_attempt_duration_seconds",
    "Wall time of one attempt of a handler, bookkeeping included (the processing time: "
    "p50/p95/p99 by histogram_quantile).",
    ["task"],
    buckets=DURATION_BUCKETS,
)
queue_wait_seconds = _Histogram(
    "explicit_queue_wait_seconds",
    "Seconds from a message's publish (its explicit_sent_at header) to the start of an "
    "attempt (delivery layer): how long jobs wait in the queue.",
    ["task"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600),
)
attempts_per_job = _Histogram(
    "explicit_attempts_per_job",
    "Attempts a job took, observed once at its final outcome (applied, succeeded, "
    "dead-lettered): 1 is a job that never retried (execution layer).",
    ["task"],
    buckets=(1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 50),
)
lock_wait_seconds = _Histogram(
    "explicit_lock_wait_seconds",
    "Time spent waiting to acquire a lease lock, by lock family (name up to ':').",
    ["lock"],
)
lock_not_acquired = _Counter(
    "explicit_lock_not_acquired_total",
    "Acquisitions that gave up after their bounded wait.",
    ["lock"],
)
locks_lost = _Counter(
    "explicit_locks_lost_total",
    "Release or extend attempted by a holder whose lock had expired or been taken.",
    ["lock", "action"],
)
dedup_dropped = _Counter(
    "explicit_dedup_dropped_total",
    "Messages dropped because another message owns their dedup id (delivery layer), "
    "at publish or at delivery.",
    ["task", "stage"],
)
lease_extensions = _Counter(
    "explicit_lease_extensions_total",
    "Times a held message's lease (per-task visibility timeout) was moved forward.",
    ["task"],
)
key_mismatches = _Counter(
    "explicit_key_mismatch_total",
    "Jobs whose published idempotency key differs from the key this worker rendered "
    "(the key template changed between publish and run): checked under both.",
    ["task"],
)
database_outage_deferrals = _Counter(
    "explicit_database_outage_deferrals_total",
    "Jobs deferred because the database could not be written (execution layer), by "
    "cause: connection, read_only, shutdown, starting, resources. Not counted as "
    "retries, never dead-lettered for it.",
    ["task", "cause"],
)
unreadable_messages = _Counter(
    "explicit_unreadable_messages_total",
    "Messages taken off a queue that name no delivery tag (not a kombu envelope), "
    "moved to explicit:unreadable:<queue> on the broker instead of being dropped (Redis).",
    ["queue"],
)
stale_acks_withheld = _Counter(
    "explicit_stale_acks_withheld_total",
    "Acks, rejects and restores of a delivery another worker holds now, or another "
    "copy of it in this worker (a stale copy after a takeover), left without touching "
    "the broker's record of it (Redis).",
    ["action"],
)
drain_releases = _Counter(
    "explicit_drain_released_total",
    "Messages a worker in warm shutdown gave back at once because no pool process had "
    "started them (Redis broker).",
    ["task"],
)
lease_not_extended = _Counter(
    "explicit_lease_not_extended_total",
    "Leases deliberately left to run out, by reason (a stopped pool child).",
    ["task", "reason"],
)
downstream_deferred = _Counter(
    "explicit_downstream_deferred_total",
    "Executions deferred by a downstream's limits, by reason: open (breaker open), "
    "probing (another execution is the probe), busy (concurrency limit).",
    ["downstream", "reason"],
)
breaker_open = _Gauge(
    "explicit_breaker_open",
    "1 while a downstream's circuit breaker is open, as last seen by any process.",
    ["downstream"],
    # The latest write of any pool child (dead ones included) is the freshest view;
    # "max" would keep a dead child's 1 forever.
    multiprocess_mode="mostrecent",
)
redeliveries = _Counter(
    "explicit_redeliveries_total",
    "Messages the broker delivered again (delivery layer; retries are not counted), by "
    "cause: lease_expired (the execution lease ran out: a stopped or dead worker on "
    "another host), holder_dead (its process died on this host), broker (no live "
    "execution held it: a connection loss after the end, a requeue).",
    ["task", "cause"],
)
concurrent_executions_deferred = _Counter(
    "explicit_concurrent_executions_deferred_total",
    "Deliveries deferred because another live execution of the same job holds its "
    "execution lease (delivery layer).",
    ["task"],
)
fenced_commits = _Counter(
    "explicit_fenced_commits_total",
    "Effects refused at commit: the execution had lost its lease to a newer one (effect layer).",
    ["task"],
)
ordering_deferred = _Counter(
    "explicit_ordering_deferred_total",
    "Deliveries deferred because an earlier job of the same entity has not ended (delivery layer).",
    ["task"],
)
ordering_skipped = _Counter(
    "explicit_ordering_skipped_total",
    "Times a job went ahead after the jobs before it in its entity never came within "
    "ordering_gap (delivery layer).",
    ["task"],
)
cancelled = _Counter(
    "explicit_cancelled_total",
    "Jobs an operator cancelled, by where they were stopped: before_start (not run) or "
    "at_commit (the effect refused) (delivery and effect layers).",
    ["task", "stage"],
)
rate_limit = _Counter(
    "explicit_rate_limit_total",
    "Jobs a keyed rate limit did not start at once, by decision: deferred (to the start "
    "reserved for it) or unguarded (the state store was unavailable: run unlimited) "
    "(delivery layer).",
    ["task", "decision"],
)
periodic_slots = _Counter(
    "explicit_periodic_slots_total",
    "Due runs of periodic entries at a beat (delivery layer), by outcome: published (this "
    "beat claimed the schedule slot and published it) or duplicate (another beat had "
    "published that slot: dropped, recorded as a deduplicated attempt).",
    ["task", "outcome"],
)
app_version_info = _Gauge(
    "explicit_app_version_info",
    "1 for the version of the code a process records its attempts under "
    "(EXPLICIT_APP_VERSION, celery_explicit.app_version; '' when unknown).",
    ["version"],
    multiprocess_mode="max",
)
