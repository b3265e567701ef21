"""celery-explicit: one explicit contract per failure mode, declared on each task.

Public API, by topic:

- declaring a task: ``ExplicitTask``, ``effect`` (for handlers without ``bind=True``)
- retry classification: ``RetryAfter``, ``Unclassified``
- errors: ``ExplicitError`` (root), ``ContractError``, ``BadInput``,
  ``IdempotencyConflict``
"""

from celery_explicit.errors import (
    BadInput,
    ContractError,
    ExplicitError,
    IdempotencyConflict,
    RetryAfter,
)
from celery_explicit.retry_policy import Unclassified
from celery_explicit.task import ExplicitTask, effect

__all__ = [
    # errors
    "BadInput",
    "ContractError",
    "ExplicitError",
    # declaring a task
    "ExplicitTask",
    "IdempotencyConflict",
    # retry classification
    "RetryAfter",
    "Unclassified",
    "effect",
]
