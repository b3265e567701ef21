"""Retry classification: which errors retry, which are permanent, and when to try again.

A task declares ``retry_on`` (transient: a timeout, a 503) and ``fail_on`` (permanent:
a validation error, a declined card). Everything else is *unclassified*: the task says
what that means (``unclassified = "permanent"`` by default), and the attempt is marked
``unclassified`` so an operator notices and classifies it.

Delays are capped exponential backoff with *full jitter* (AWS architecture blog,
"Exponential Backoff And Jitter"): ``uniform(0, min(cap, base * 2**(n-1)))``. Full
jitter spreads a burst of failures over the whole window, so a sick dependency is not
hit again by every worker at the same instant (the retry storm).
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass

from celery_explicit.errors import RetryAfter


class Classification(enum.Enum):
    RETRY = "retry"
    PERMANENT = "permanent"
    UNCLASSIFIED = "unclassified"


class Unclassified(enum.Enum):
    """What an error that is in neither ``retry_on`` nor ``fail_on`` means for a task."""

    PERMANENT = "permanent"
    RETRY = "retry"


@dataclass(frozen=True)
class RetryPolicy:
    retry_on: tuple[type[BaseException], ...]
    fail_on: tuple[type[BaseException], ...]
    unclassified: Unclassified
    max_attempts: int
    backoff_base: float
    backoff_cap: float

    def classify(self, exc: BaseException) -> Classification:
        """The most specific declared class wins: walk the exception's MRO.

        ``fail_on=(ValueError,)`` with ``retry_on=(Exception,)`` makes a ValueError
        permanent and anything else retryable, whatever the declaration order.
        ``RetryAfter`` is always retryable: raising it is the handler's explicit choice.
        """
        if isinstance(exc, RetryAfter):
            return Classification.RETRY
        for klass in type(exc).__mro__:
            if klass in self.fail_on:
                return Classification.PERMANENT
            if klass in self.retry_on:
                return Classification.RETRY
        return Classification.UNCLASSIFIED

    def should_retry(self, exc: BaseException) -> bool:
        kind = self.classify(exc)
        if kind is Classification.UNCLASSIFIED:
            return self.unclassified is Unclassified.RETRY
        return kind is Classification.RETRY

    def delay(
        self, attempt: int, exc: BaseException | None = None, *, rng: random.Random | None = None
    ) -> float:
        """Seconds to wait before attempt ``attempt + 1``; ``attempt`` counts from 1.

        A ``retry_after`` carried by the exception (a 429's Retry-After header) wins
        over the computed delay: the downstream knows better than our formula. It is
        capped by ``backoff_cap`` all the same: a retry waits in a worker holding its
        message, and a wait past the broker's limits (RabbitMQ's ``consumer_timeout``,
        the Redis backstop) would redeliver it meanwhile.
        """
        retry_after = getattr(exc, "retry_after", None)
        if (
            isinstance(retry_after, int | float)
            and not isinstance(retry_after, bool)
            and math.isfinite(retry_after)
            and retry_after >= 0
        ):
            return min(float(retry_after), self.backoff_cap)
        return backoff_delay(attempt, base=self.backoff_base, cap=self.backoff_cap, rng=rng)


def backoff_ceiling(attempt: int, *, base: float, cap: float) -> float:
    """The longest backoff after the ``attempt``-th failure (1-based): the jitter's
    upper bound, and what a reader of the schedule (a retention floor) must allow."""
    if attempt < 1:
        raise ValueError(f"attempt counts from 1, got {attempt}")
    # Bound the exponent so a large attempt number cannot overflow the float.
    return min(cap, base * float(2 ** min(attempt - 1, 62)))


def backoff_delay(
    attempt: int, *, base: float, cap: float, rng: random.Random | None = None
) -> float:
    """Full-jitter exponential backoff for the ``attempt``-th failure (1-based)."""
    return (rng or random).uniform(0.0, backoff_ceiling(attempt, base=base, cap=cap))
