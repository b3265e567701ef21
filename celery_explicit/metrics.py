"""Prometheus metrics. Each name says which layer it counts: delivery, execution, effect.

With the prefork pool every child counts in its own memory: set
``PROMETHEUS_MULTIPROC_DIR`` before the worker starts and expose the registry with
``prometheus_client.multiprocess.MultiProcessCollector`` (prometheus_client's docs).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

executions = Counter(
    "explicit_executions_total",
    "Executions of a handler (execution layer), by how they ended.",
    ["task", "outcome"],
)
effects_applied = Counter(
    "explicit_effects_applied_total",
    "Effects committed with their ledger row (effect layer).",
    ["task"],
)
duplicates_absorbed = Counter(
    "explicit_idempotency_conflicts_total",
    "Executions that found their key already in the ledger (effect layer). "
    "kind=duplicate: same arguments, absorbed; kind=arguments: other arguments, "
    "dead-lettered.",
    ["task", "kind"],
)
retries_scheduled = Counter(
    "explicit_retries_scheduled_total",
    "Retries scheduled after a retryable error (execution layer).",
    ["task", "error_class"],
)
dead_letters = Counter(
    "explicit_dead_letters_total",
    "Messages dead-lettered, by reason (delivery or execution layer).",
    ["task", "reason"],
)
attempt_seconds = Histogram(
    "explicit_attempt_duration_seconds",
    "Wall time of one attempt of a handler, bookkeeping included.",
    ["task"],
)
lock_wait_seconds = Histogram(
    "explicit_lock_wait_seconds",
    "Time spent waiting to acquire a lease lock, by lock family (name up to ':').",
    ["lock"],
)
lock_not_acquired = Counter(
    "explicit_lock_not_acquired_total",
    "Acquisitions that gave up after their bounded wait.",
    ["lock"],
)
locks_lost = Counter(
    "explicit_locks_lost_total",
    "Release or extend attempted by a holder whose lock had expired or been taken.",
    ["lock", "action"],
)
dedup_dropped = Counter(
    "explicit_dedup_dropped_total",
    "Messages dropped because another message owns their dedup id (delivery layer), "
    "at publish or at delivery.",
    ["task", "stage"],
)
lease_extensions = Counter(
    "explicit_lease_extensions_total",
    "Times a held message's lease (per-task visibility timeout) was moved forward.",
    ["task"],
)
lease_not_extended = Counter(
    "explicit_lease_not_extended_total",
    "Leases deliberately left to run out, by reason (a stopped pool child).",
    ["task", "reason"],
)
downstream_deferred = Counter(
    "explicit_downstream_deferred_total",
    "Executions deferred by a downstream's limits, by reason: open (breaker open), "
    "probing (another execution is the probe), busy (concurrency limit).",
    ["downstream", "reason"],
)
breaker_open = Gauge(
    "explicit_breaker_open",
    "1 while a downstream's circuit breaker is open, as last seen by this process.",
    ["downstream"],
    multiprocess_mode="max",
)
redeliveries = Counter(
    "explicit_redeliveries_total",
    "Messages the broker delivered again (delivery layer; retries are not counted), by "
    "cause: lease_expired (the execution lease ran out: a stopped or dead worker on "
    "another host), holder_dead (its process died on this host), broker (no live "
    "execution held it: a connection loss after the end, a requeue).",
    ["task", "cause"],
)
concurrent_deferred = Counter(
    "explicit_concurrent_executions_deferred_total",
    "Deliveries deferred because another live execution of the same job holds its "
    "execution lease (delivery layer).",
    ["task"],
)
fenced_commits = Counter(
    "explicit_fenced_commits_total",
    "Effects refused at commit: the execution had lost its lease to a newer one (effect layer).",
    ["task"],
)
ordering_deferred = Counter(
    "explicit_ordering_deferred_total",
    "Deliveries deferred because an earlier job of the same entity has not ended (delivery layer).",
    ["task"],
)
ordering_skipped = Counter(
    "explicit_ordering_skipped_total",
    "Times a job went ahead after the jobs before it in its entity never came within "
    "ordering_gap (delivery layer).",
    ["task"],
)
