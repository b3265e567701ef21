"""How an attempt ended and why a message became a dead letter: the words of our data.

Stored in the attempt and dead-letter tables (``django_outbox``) and used by the job
path, the logs and the metrics; one enum each, so the code, the columns and the admin
say the same word.
"""

from __future__ import annotations

from django.db import models


class Outcome(models.TextChoices):
    """How one attempt (one execution of the handler) ended."""

    APPLIED = "applied", "effect applied"
    ALREADY_APPLIED = "already_applied", "already applied (duplicate absorbed)"
    SUCCEEDED = "succeeded", "succeeded (no effect block)"
    RETRY_SCHEDULED = "retry_scheduled", "retry scheduled"
    FAILED_PERMANENT = "failed_permanent", "failed: permanent error"
    FAILED_UNCLASSIFIED = "failed_unclassified", "failed: unclassified error"
    EXHAUSTED = "exhausted", "failed: attempts exhausted"
    BAD_INPUT = "bad_input", "bad input"
    CONFLICT = "conflict", "idempotency conflict (other arguments)"
    DEDUPLICATED = "deduplicated", "dropped: another message owns its dedup id"
    DELIVERY_LIMIT = "delivery_limit", "not run: delivered more than max_deliveries times"
    MAX_RUN_TIME = "max_run_time", "stopped: ran longer than max_run_time"
    FENCED = "fenced", "refused: lost its lease to a newer execution (stale fencing token)"
    DATABASE_UNAVAILABLE = "database_unavailable", "deferred: the database could not be written"
    CANCELLED = "cancelled", "cancelled by an operator: not run, or its effect refused"


class DeadLetterReason(models.TextChoices):
    PERMANENT = "permanent", "permanent error"
    UNCLASSIFIED = "unclassified", "unclassified error (classify it)"
    EXHAUSTED = "exhausted", "attempts exhausted"
    BAD_INPUT = "bad_input", "bad input"
    CONFLICT = "conflict", "idempotency conflict"
    DELIVERY_LIMIT = "delivery_limit", "delivered more than max_deliveries times"
    MAX_RUN_TIME = "max_run_time", "ran longer than max_run_time"
    UNKNOWN_TASK = "unknown_task", "no such task is registered"
    NOT_RECEIVED = "not_received", "published, never received by a worker"


__all__ = ["DeadLetterReason", "Outcome"]
