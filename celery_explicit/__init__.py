"""celery-explicit: one explicit contract per failure mode, declared on each task.

Public API, by topic:

- declaring a task: ``ExplicitTask``, ``effect`` (for handlers without ``bind=True``)
- retry classification: ``RetryAfter``, ``Unclassified``
- per-downstream limits: ``Downstream`` (see ``celery_explicit.downstream``)
- keyed rate limits: ``RateLimit`` (see ``celery_explicit.rate_limit``)
- lease locks: ``LeaseLock`` (see ``celery_explicit.locks``)
- errors: ``ExplicitError`` (root), ``ContractError``, ``BadInput``,
  ``IdempotencyConflict``, ``LockError`` and its kinds, ``StaleFencingToken``,
  ``JobCancelled``
"""

from celery_explicit.downstream import Downstream
from celery_explicit.errors import (
    BadInput,
    ContractError,
    ExplicitError,
    IdempotencyConflict,
    JobCancelled,
    LeaseLost,
    LockConfigError,
    LockError,
    LockNotAcquired,
    LockNotOwned,
    LockNotReplicated,
    RetryAfter,
    StaleFencingToken,
    StaleVersion,
)
from celery_explicit.locks import LeaseLock
from celery_explicit.rate_limit import RateLimit
from celery_explicit.retry_policy import Unclassified
from celery_explicit.task import ExplicitTask, effect

__all__ = [
    # declaring a task
    "ExplicitTask",
    "effect",
    # retry classification
    "RetryAfter",
    "Unclassified",
    # per-downstream limits
    "Downstream",
    # keyed rate limits
    "RateLimit",
    # lease locks
    "LeaseLock",
    # errors
    "ExplicitError",
    "ContractError",
    "BadInput",
    "IdempotencyConflict",
    "LockError",
    "LockConfigError",
    "LockNotAcquired",
    "LockNotReplicated",
    "LockNotOwned",
    "LeaseLost",
    "JobCancelled",
    "StaleFencingToken",
    "StaleVersion",
]
