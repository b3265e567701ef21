"""The retry storm's tasks: a job that calls a sick HTTP downstream through its declared
limits.

The downstream is a small HTTP server in the test process (tests/chaos/test_retry_storm.py);
it answers 503 during its outage, 400 to the jobs it marks as invalid, 200 otherwise.
A 503 is transient (``retry_on``), a 4xx permanent (``fail_on``): the library's retry
policy and the downstream's breaker do the rest.

``CallDownstreamStorm`` is the negative control only, the classic retry storm: the same
task without the breaker (``downstream = None``) and with every retry delay
deterministic (the backoff at its ceiling), to show what jitter and the breaker are
there to prevent. Library behaviour is untouched: the control swaps its own contract's
retry policy, nothing else.
"""

from __future__ import annotations

import dataclasses
import http.client
import os
import random
from typing import Any
from urllib.parse import urlsplit

from celery_explicit import ExplicitTask
from celery_explicit.downstream import Downstream
from celery_explicit.retry_policy import RetryPolicy
from tests.celery_app import app
from tests.chaos import history
from tests.chaos.report import scaled


class Unavailable(Exception):
    """The downstream answered 503: it may answer 200 later."""


class Rejected(Exception):
    """The downstream answered 4xx: the request itself is wrong, no retry can fix it."""


def _downstream(name: str) -> Downstream:
    # 5 failures in a row open it; one probe a second while it is open. defer_base is
    # the spread of a deferred job's return: every deferred job comes back about once
    # per defer_base, so it grows with the backlog (150 short, 1,000 full) to keep that
    # churn within what two shared CPUs can serve; short enough to drain in seconds.
    # Concurrency above the workers' pool: the limit itself is not under test here.
    return Downstream(
        name,
        concurrency=16,
        failure_threshold=5,
        cool_down=1.0,
        defer_base=scaled(15, 80) / 10,
    )


SICK_DOWNSTREAM = _downstream("chaos-sick-downstream")


def call(url: str, run: str, job: int) -> int:
    """One request to the fake downstream; its status code."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("POST", f"/{run}/{job}")
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


class CallDownstream(ExplicitTask):
    name = "chaos.call_downstream"
    idempotency_key = "chaos:{run}:{job}"
    downstream = SICK_DOWNSTREAM
    visibility_timeout = 10
    expected_duration = 1
    retry_on = (Unavailable,)
    fail_on = (Rejected,)
    # The breaker defers (no attempt used) while it is open: attempts are the few
    # failures before it opens plus probes; 20 is far from exhausted.
    max_attempts = 20
    backoff_base = 0.2
    backoff_cap = 2.0

    def run(self, run: str, job: int, url: str) -> None:
        status = call(url, run, job)
        if status == 503:
            raise Unavailable(f"downstream answered 503 to job {job} of run {run}")
        if 400 <= status < 500:
            raise Rejected(f"downstream answered {status} to job {job} of run {run}")
        with self.effect():
            history.record_effect(run, job, os.getpid())


class _NoJitterPolicy(RetryPolicy):
    """Capped exponential backoff without jitter: the delay is the window's ceiling."""

    def delay(
        self, attempt: int, exc: BaseException | None = None, *, rng: random.Random | None = None
    ) -> float:
        return min(self.backoff_cap, self.backoff_base * 2 ** min(attempt - 1, 62))


class CallDownstreamStorm(CallDownstream):
    """The negative control, the classic retry storm: no breaker (``downstream = None``:
    every retry reaches the sick downstream) and no jitter (every job's n-th retry waits
    exactly as long as every other job's)."""

    name = "chaos.call_downstream_storm"
    downstream = None


def _without_jitter(cls: Any) -> None:
    # Set after the class is built: __init_subclass__ builds the contract from the
    # declarations, and no declaration turns jitter off (on purpose).
    policy = cls.contract.retry
    fields = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    cls.contract = dataclasses.replace(cls.contract, retry=_NoJitterPolicy(**fields))


_without_jitter(CallDownstreamStorm)

app.register_task(CallDownstream())
app.register_task(CallDownstreamStorm())
