"""The keyed rate limit's admission on a real Redis: a burst of ``limit``, then one
start reserved a period after the ``limit``-th before it; keys independent; a job
whose key does not render refused at publish; without Redis, run unlimited, counted."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest
from django.utils import timezone

from celery_explicit import BadInput, RateLimit, metrics, rate_limit
from celery_explicit.execution import Execution
from celery_explicit.rate_limit import RateLimitStep, admit, limited_keys
from celery_explicit.steps import RUN, Defer, Job
from tests.testapp.tasks_rate_limit import CallLimitedApi


@pytest.fixture
def key(redis_client):  # type: ignore[no-untyped-def]
    name = f"test-admit:{uuid.uuid4().hex[:8]}"
    yield name
    redis_client.delete(*rate_limit.state_keys(name))


def test_a_burst_of_limit_then_starts_one_interval_apart(key: str) -> None:
    limit = RateLimit("test-admit:{k}", 3, per=2.0)
    answers = [admit(limit, key) for _ in range(9)]
    waits = [wait for wait, _start, _why in answers]
    starts = [start for _wait, start, _why in answers]
    assert [why for _w, _s, why in answers] == ["started"] * 3 + ["reserved"] * 6
    assert waits[:3] == [0.0, 0.0, 0.0]  # a burst of the limit goes at once
    for later in range(3, 9):
        # A period after the limit-th start before it, an interval (2 s / 3) after the
        # last: a backlog is spread evenly, not sent in bursts.
        assert starts[later] >= starts[later - 3] + 2000
        assert starts[later] - starts[later - 1] >= 666
    assert 5.2 <= waits[-1] <= 5.5  # the ninth: two periods and two intervals on
    # No window of one period holds more than three.
    for first in range(len(starts)):
        inside = [s for s in starts if starts[first] <= s < starts[first] + 2000]
        assert len(inside) <= 3


def test_keys_are_independent(key: str, redis_client) -> None:  # type: ignore[no-untyped-def]
    limit = RateLimit("test-admit:{k}", 1, per=60.0)
    assert admit(limit, key)[0] == 0.0
    assert admit(limit, key)[0] > 59.0
    other = f"{key}-other"
    try:
        assert admit(limit, other)[0] == 0.0  # a quiet key does not wait
    finally:
        redis_client.delete(*rate_limit.state_keys(other))


def test_the_state_lasts_one_period_after_the_last_start(key: str, redis_client) -> None:  # type: ignore[no-untyped-def]
    limit = RateLimit("test-admit:{k}", 2, per=3.0)
    admit(limit, key)
    admit(limit, key)
    admit(limit, key)  # reserved 3 s ahead
    ttl = redis_client.pttl(rate_limit.state_keys(key)[0])
    assert 5_000 < ttl <= 6_100
    assert redis_client.llen(rate_limit.state_keys(key)[0]) == 2


def test_a_key_keeps_only_the_starts_of_its_last_period(key: str, redis_client) -> None:  # type: ignore[no-untyped-def]
    import time

    limit = RateLimit("test-admit:{k}", 100, per=0.3)
    for _ in range(5):
        admit(limit, key)
    assert redis_client.llen(rate_limit.state_keys(key)[0]) == 5
    time.sleep(0.4)
    assert admit(limit, key)[0] == 0.0
    assert redis_client.llen(rate_limit.state_keys(key)[0]) == 1


def test_bad_input_for_the_key_is_refused_at_publish() -> None:
    with pytest.raises(BadInput) as caught:
        CallLimitedApi().apply_async(kwargs={"account": None, "job": 1, "tag": "t"})
    assert "tests.call_limited_api" in str(caught.value)
    assert "rate limit key field 'account' is None" in str(caught.value)


def execution(key: str) -> Execution:
    return Execution(
        task_id=uuid.uuid4().hex,
        task_name=CallLimitedApi.name,
        key="k",
        fingerprint="",
        attempt=1,
        started_at=timezone.now(),
        correlation_id="",
        rate_key=key,
    )


def back(step: RateLimitStep, key: str, reserved_ms: int) -> tuple[object, Execution]:
    """The step's decision for a job coming back with its reservation."""
    came = execution(key)
    request = SimpleNamespace(retries=0, **{rate_limit.SLOT_HEADER: f"0:{reserved_ms}"})
    return step.before_run(Job(CallLimitedApi.name, request, came)), came


def test_the_step_defers_to_the_reservation_and_lists_the_key(key: str) -> None:
    step = RateLimitStep(CallLimitedApi.name, RateLimit("test-admit:{k}", 1, per=30.0))
    first = execution(key)
    assert step.before_run(Job(CallLimitedApi.name, SimpleNamespace(retries=0), first)) is RUN
    second = execution(key)
    decision = step.before_run(Job(CallLimitedApi.name, SimpleNamespace(retries=0), second))
    assert isinstance(decision, Defer)
    assert 29.0 < decision.seconds <= 30.0
    assert f"rate limit {key} (1 per 30s) has no room" in decision.reason
    # The re-publish carries the reservation: the job keeps its place.
    retries, start = second.deferral_headers[rate_limit.SLOT_HEADER].split(":")
    assert retries == "0"
    assert key in dict(limited_keys())
    # Back before its reservation (a clock or a timer early): it waits the rest.
    early, _ = back(step, key, int(start))
    assert isinstance(early, Defer) and 29.0 < early.seconds <= 30.0


def test_a_due_job_starts_only_if_the_last_period_has_room(key: str) -> None:
    step = RateLimitStep(CallLimitedApi.name, RateLimit("test-admit:{k}", 2, per=30.0))
    _wait, now_ms, _why = admit(step.limit, key)  # one start made now
    # Two jobs come back late on reservations already due: one fits, the other waits
    # for the moment the period has room, keeping its reservation.
    decided, came = back(step, key, now_ms - 5_000)
    assert decided is RUN
    assert came.deferral_headers[rate_limit.SLOT_HEADER] == f"0:{now_ms - 5_000}"
    waiting, came = back(step, key, now_ms - 4_000)
    # Until the first start is a period old, spread by up to an interval (15 s here).
    assert isinstance(waiting, Defer) and 29.0 < waiting.seconds <= 45.0
    assert came.deferral_headers[rate_limit.SLOT_HEADER] == f"0:{now_ms - 4_000}"


def test_without_redis_the_job_runs_unlimited_and_is_counted(monkeypatch, key: str) -> None:  # type: ignore[no-untyped-def]
    import redis

    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    monkeypatch.setattr(rate_limit.redis_state, "client", lambda: dead)
    counted = metrics.rate_limit.labels(CallLimitedApi.name, "unguarded")
    before = counted._value.get()
    step = RateLimitStep(CallLimitedApi.name, RateLimit("test-admit:{k}", 1, per=30.0))
    assert (
        step.before_run(Job(CallLimitedApi.name, SimpleNamespace(retries=0), execution(key))) is RUN
    )
    assert counted._value.get() == before + 1
