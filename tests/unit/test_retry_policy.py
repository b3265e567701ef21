from __future__ import annotations

import random
import statistics

import pytest

from celery_explicit import RetryAfter
from celery_explicit.retry_policy import (
    Classification,
    RetryPolicy,
    Unclassified,
    backoff_delay,
)


class Timeout(Exception):
    pass


class ReadTimeout(Timeout):
    pass


def policy(**kw: object) -> RetryPolicy:
    base = dict(
        retry_on=(Timeout,),
        fail_on=(ValueError,),
        unclassified=Unclassified.PERMANENT,
        max_attempts=5,
        backoff_base=1.0,
        backoff_cap=30.0,
    )
    return RetryPolicy(**{**base, **kw})  # type: ignore[arg-type]


def test_classification_follows_the_exception_mro() -> None:
    p = policy(retry_on=(Exception,), fail_on=(ValueError,))
    assert p.classify(ValueError()) is Classification.PERMANENT
    assert p.classify(KeyError()) is Classification.RETRY
    assert policy().classify(ReadTimeout()) is Classification.RETRY
    assert policy().classify(KeyError()) is Classification.UNCLASSIFIED


def test_unclassified_means_what_the_task_declared() -> None:
    assert not policy().should_retry(KeyError())
    assert policy(unclassified=Unclassified.RETRY).should_retry(KeyError())
    assert policy().should_retry(RetryAfter(3))


def test_retry_after_carried_by_the_exception_wins() -> None:
    exc = Timeout()
    exc.retry_after = 7.5  # type: ignore[attr-defined]
    assert policy().delay(1, exc) == 7.5
    assert policy().delay(3, RetryAfter(2)) == 2.0


def test_backoff_is_full_jitter_under_a_cap() -> None:
    rng = random.Random(42)
    for attempt, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (6, 30.0), (200, 30.0)]:
        delays = [backoff_delay(attempt, base=1.0, cap=30.0, rng=rng) for _ in range(2000)]
        assert min(delays) >= 0.0 and max(delays) <= ceiling
        # Full jitter is uniform on [0, ceiling]: mean near half, and spread across it.
        assert statistics.mean(delays) == pytest.approx(ceiling / 2, rel=0.08)
        assert max(delays) > 0.9 * ceiling and min(delays) < 0.1 * ceiling


def test_backoff_rejects_attempt_zero() -> None:
    with pytest.raises(ValueError, match="attempt counts from 1"):
        backoff_delay(0, base=1, cap=2)


def test_a_non_finite_retry_after_falls_back_to_backoff() -> None:
    exc = Timeout()
    exc.retry_after = float("inf")  # type: ignore[attr-defined]
    assert 0 <= policy().delay(1, exc) <= 1.0


def test_a_retry_after_longer_than_the_cap_is_capped() -> None:
    # A retry waits in a worker holding its message: past the broker's limits it
    # would be redelivered meanwhile, so the task's cap holds for the downstream too.
    assert policy().delay(1, RetryAfter(3600)) == 30.0
