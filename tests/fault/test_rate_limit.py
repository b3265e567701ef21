"""Fault tests: a keyed rate limit holds across four workers, and is fair across keys.

- Four workers, a backlog of one account's jobs at five a second: the starts of that
  account stay within five in any second, give or take a start that came back late to
  a busy worker, and the backlog takes as long as the limit says. Negative control:
  Celery's ``rate_limit="5/s"`` on the same four workers lets about four times as many
  through (each worker keeps its own).
- A backlog of one account ahead of one job of another: the quiet account's job starts
  within seconds, long before the backlog is through. Negative control: the same job
  on the noisy account's key waits for the backlog.

Starts are written down by the handlers with the Redis server's clock (one clock for
every worker).
"""

from __future__ import annotations

import collections
import uuid

import pytest

from django_outbox.models import Attempt, Outcome
from tests.support.explaining import explain
from tests.support.scale import scaled
from tests.support.waiting import wait_for
from tests.testapp.tasks_rate_limit import API, CallLimitedApi, call_api_celery_rate_limit

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]

JOBS = scaled(30, 300)


def starts(redis_client, tag: str) -> list[tuple[str, int]]:  # type: ignore[no-untyped-def]
    rows = [raw.decode().split("|") for raw in redis_client.lrange(f"{tag}:starts", 0, -1)]
    return sorted(((account, int(ms)) for account, ms, _slot in rows), key=lambda row: row[1])


def lateness(redis_client, tag: str) -> list[int]:  # type: ignore[no-untyped-def]
    """How late each deferred job started after its reservation (ms), the latest first."""
    late = []
    for raw in redis_client.lrange(f"{tag}:starts", 0, -1):
        _account, at, slot = raw.decode().split("|")
        if slot:
            late.append(int(at) - int(slot.split(":")[1]))
    return sorted(late, reverse=True)


def most_in_one_period(times: list[int], period_ms: int) -> int:
    """The most starts in any half-open window of ``period_ms``."""
    most, first = 0, 0
    for last, at in enumerate(times):
        while at - times[first] >= period_ms:
            first += 1
        most = max(most, last - first + 1)
    return most


@pytest.fixture(autouse=True)
def clean_limits(redis_client):  # type: ignore[no-untyped-def]
    from celery_explicit import rate_limit

    def wipe() -> None:
        for account in ("acct-noisy", "acct-quiet"):
            redis_client.delete(*rate_limit.state_keys(f"test-api:{account}"))

    wipe()
    yield
    wipe()


@pytest.mark.parametrize("limiter", ["explicit", "celery"], ids=["rate-limit", "control"])
def test_the_limit_holds_across_four_workers(
    start_worker, queue: str, redis_client, limiter: str
) -> None:
    tag = f"rl-{uuid.uuid4().hex[:8]}"
    for _ in range(4):
        start_worker(concurrency=1)
    task = CallLimitedApi() if limiter == "explicit" else call_api_celery_rate_limit
    for job in range(JOBS):
        task.apply_async(kwargs={"account": "acct-noisy", "job": job, "tag": tag}, queue=queue)
    wait_for(
        lambda: redis_client.llen(f"{tag}:starts") >= JOBS,
        timeout=JOBS / API.limit * 3 + 30,
        what="every job started",
    )
    times = [ms for _account, ms in starts(redis_client, tag)]
    assert len(times) == JOBS  # each job started once
    busiest = most_in_one_period(times, int(API.per * 1000))
    span = (times[-1] - times[0]) / 1000.0
    if limiter == "explicit":
        # Five starts a second on the Redis server's clock when admitted; each handler
        # writes its own a few milliseconds later, which can bring two starts a period
        # apart into one second here.
        assert busiest <= API.limit + 1, (busiest, lateness(redis_client, tag))
        # The backlog takes as long as the limit says: a burst of five, then five a
        # second.
        assert span >= (JOBS - API.limit) / API.limit * 0.95, span
        ran = Attempt.objects.filter(task_name=CallLimitedApi.name, outcome=Outcome.SUCCEEDED)
        # Each handler writes its start before its attempt row: wait for the last rows.
        wait_for(lambda: ran.count() >= JOBS, timeout=30, what="every attempt recorded")
        outcomes = collections.Counter(
            Attempt.objects.filter(task_name=CallLimitedApi.name).values_list("outcome", flat=True)
        )
        assert ran.count() == JOBS, (outcomes, lateness(redis_client, tag)[:5])
        deferred = [(a.deferrals or {}).get("rate_limit", 0) for a in ran]
        assert sum(deferred) >= JOBS - API.limit * 2  # most were deferred
        # explain says why the last job waited.
        last = max(ran, key=lambda a: (a.deferrals or {}).get("rate_limit", 0))
        assert "its key's rate limit had no room" in explain(last.idempotency_key)
    else:
        # Each worker keeps its own five a second: about four times the limit.
        assert busiest >= API.limit * 2, (busiest, times)
        assert span < (JOBS - API.limit) / API.limit * 0.6, span


@pytest.mark.parametrize("quiet", ["acct-quiet", "acct-noisy"], ids=["fair", "control"])
def test_a_quiet_key_does_not_wait_behind_a_noisy_one(
    start_worker, queue: str, redis_client, quiet: str
) -> None:
    tag = f"rlf-{uuid.uuid4().hex[:8]}"
    backlog = JOBS
    for job in range(backlog):
        CallLimitedApi().apply_async(
            kwargs={"account": "acct-noisy", "job": job, "tag": tag}, queue=queue
        )
    CallLimitedApi().apply_async(kwargs={"account": quiet, "job": -1, "tag": tag}, queue=queue)
    for _ in range(2):
        start_worker(concurrency=2)
    wait_for(
        lambda: redis_client.llen(f"{tag}:starts") >= backlog + 1,
        timeout=backlog / API.limit * 3 + 30,
        what="every job started",
    )
    rows = starts(redis_client, tag)
    # Counted from the first start of all: the workers' start-up is nobody's wait.
    first_ms = rows[0][1]
    backlog_done = (rows[-1][1] - first_ms) / 1000.0
    # The job's own start: its attempt row (on the control's shared key its start is
    # one of many alike).
    job = Attempt.objects.get(idempotency_key=f"api-call:{tag}:-1")
    quiet_wait = job.started_at.timestamp() - first_ms / 1000.0
    assert backlog_done >= (backlog - API.limit) / API.limit * 0.95, backlog_done
    if quiet == "acct-quiet":
        # Its wait: the workers passing once over the backlog ahead of it.
        assert quiet_wait < backlog_done / 3, (quiet_wait, backlog_done)
    else:
        # On the noisy key it is one of the backlog: it waits its turn at the end.
        assert quiet_wait >= (backlog - API.limit) / API.limit * 0.9, quiet_wait
