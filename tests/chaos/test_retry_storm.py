"""A retry storm. The downstream answers 503 for an outage window while a backlog of
jobs calls it (5 s over 150 jobs short, 20 s over 1,000 full); one job in ten is
invalid and answered 400 whatever the downstream's health.

Must hold: every valid job done after recovery, 0 lost, 0 duplicates; a 4xx job has
exactly one attempt and a dead letter; the breaker opened, probed and closed (sampled
from its Redis hash: ``BreakerWatch``); and the sick downstream is spared (below).
Negative control: the classic storm, the same jobs through ``CallDownstreamStorm``
(``tasks_retry_storm``): no breaker and no jitter, every job's n-th retry after exactly the same
delay. It must show the storm.

The statistic asserted is the **outage load**: attempts per second while the downstream
is down, divided by attempts per second in the drain (outage end to the last attempt,
the pace the same workers showed they can sustain). An attempt is one ``Attempt`` row,
one request to the downstream; a deferral by the breaker writes none. It must be at
most 0.5 for the jittered run and above 0.5 for the control. Measured, short scale,
9 runs each: jittered 0.05-0.26, control 0.65-0.82. Why this one and not a bound on
the peak:

- The obvious bound, "peak attempts per 100 ms at most 2x the mean", is reported
  (``peak/mean per 100 ms``, mean over the non-empty buckets, for both runs) but NOT
  asserted: it does not tell the two apart here. Two workers x 4 processes on two
  shared CPUs serve ~40-50 attempts a second, so the storm's 150 synchronized retries
  queue in the pool and reach the downstream as a flat plateau at the workers' pace
  (control 1.51-2.27 over 9 runs), while the jittered run drains at the same pace
  (1.63-2.71): both straddle 2 by chance at a few attempts per bucket.
- Every shape statistic that counts the empty buckets (peak/mean per 100 ms or per
  1 s over outage start to last attempt, variance/mean) ranks them the wrong way: the
  breaker's silence during the outage followed by the drain is "peakier" (dispersion
  2.5-6.8 over 9 runs; peak/mean per 100 ms 3.2-4.9 over 5) than the control's
  saturated plateau (0.42-0.81; 1.6-2.4). The silence is the breaker's job, not a storm.
- What separates them, in every run and by a factor of at least 2.5, is where the
  workers' pace goes while the downstream is down: the control aims most of it at
  the sick downstream (0.65-0.82), the breaker holds it to its failure threshold and one probe per
  cool-down (a 4xx probe closes the breaker, the gateway did answer, and the next 503s
  open it again: the worst runs). It is a ratio of two rates measured in the same run
  on the same workers, so a busy machine slows both and leaves it about unchanged.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kombu import Connection

from celery_explicit import downstream as downstream_mod
from django_outbox.models import Attempt, DeadLetter
from tests.chaos import history
from tests.chaos.report import Row, scaled
from tests.chaos.tasks_retry_storm import CallDownstream, CallDownstreamStorm
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.worker,
    pytest.mark.django_db(transaction=True),
    # 300 s at the short scale: it ran about a minute on a quiet machine, and a machine
    # twice as slow must not be cut off by the timeout; the full scale runs for minutes.
    pytest.mark.timeout(scaled(300, 600)),
]

JOBS = scaled(150, 1000)
OUTAGE = scaled(5, 20)  # seconds the downstream answers 503
BUCKET = 0.1  # seconds: the 2x bound's "attempts per 100 ms"


def invalid(job: int) -> bool:
    """The jobs the downstream answers 400: one in ten."""
    return job % 10 == 3


class FakeDownstream:
    """An HTTP server in the test process: 503 while ``down``, 400 to invalid jobs
    (the gateway rejects a malformed request before the sick backend sees it), else
    200. It records every request (time, job, status)."""

    def __init__(self) -> None:
        self.down = False
        self.requests: list[tuple[float, int, int]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                job = int(self.path.rsplit("/", 1)[1])
                status = 400 if invalid(job) else 503 if fake.down else 200
                fake.requests.append((time.time(), job, status))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class BreakerWatch:
    """Samples the downstream's breaker hash (Redis) every 20 ms: the states it went
    through, and each opening (a new ``opened_ms``: the first opening, then one per
    failed probe). A probe that succeeds closes it; a probe that fails re-opens it."""

    def __init__(self, downstream: Any, redis_client: Any) -> None:
        self.downstream, self.redis = downstream, redis_client
        self.states: list[str] = []
        self.openings: set[str] = set()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            info = downstream_mod.state(self.downstream, redis_client=self.redis)
            if not self.states or self.states[-1] != info["state"]:
                self.states.append(info["state"])
            if info.get("opened_ms"):
                self.openings.add(info["opened_ms"])
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()


def spread(times: list[float], start: float, end: float) -> dict[str, float]:
    """Attempts per 100 ms bucket over [start, end): the peak, and the mean over the
    non-empty buckets (a bucket with no attempt at all, the breaker holding everyone
    back, is not part of the storm's traffic)."""
    counts = Counter(int((t - start) / BUCKET) for t in times if start <= t < end)
    if not counts:
        return {"peak": 0, "mean": 0.0, "ratio": math.inf, "buckets": 0, "all_mean": 0.0, "span": 1}
    peak = max(counts.values())
    mean = sum(counts.values()) / len(counts)
    all_buckets = max(1, math.ceil((end - start) / BUCKET))
    return {
        "peak": peak,
        "mean": round(mean, 2),
        "ratio": round(peak / mean, 2),
        "buckets": len(counts),
        "all_mean": round(sum(counts.values()) / all_buckets, 2),
        "span": all_buckets,
    }


def storm(task: Any, run: str, queue: str, redis_client: Any) -> dict[str, Any]:
    from django.conf import settings

    downstream = task.contract.downstream or CallDownstream.contract.downstream
    redis_client.delete(*downstream_mod.keys(downstream.name))
    fake = FakeDownstream()
    watch = BreakerWatch(downstream, redis_client)
    try:
        fake.down = True
        outage_start = time.time()
        history.record_published(run, range(JOBS))
        with Connection(settings.CELERY_BROKER_URL) as conn:
            for job in range(JOBS):
                task.apply_async(
                    kwargs={"run": run, "job": job, "url": fake.url}, queue=queue, connection=conn
                )
        time.sleep(max(0.0, outage_start + OUTAGE - time.time()))
        fake.down = False
        outage_end = time.time()
        # A job still missing after this is counted lost by the row, not raised here.
        with contextlib.suppress(TimeoutError):
            wait_for(
                lambda: history.check(run).lost == 0,
                timeout=60 + JOBS * 0.1,
                interval=0.5,
                what="every job done or dead-lettered",
            )
        time.sleep(1.0)  # late retries of a 4xx job would land here
    finally:
        watch.stop()
        fake.close()
        redis_client.delete(*downstream_mod.keys(downstream.name))
    rows = list(
        Attempt.objects.filter(
            task_name=task.name, idempotency_key__startswith=f"chaos:{run}:"
        ).values_list("idempotency_key", "started_at", "outcome")
    )
    times = sorted(started.timestamp() for _, started, _ in rows)
    per_key = Counter(key for key, _, _ in rows)
    invalid_keys = [f"chaos:{run}:{j}" for j in range(JOBS) if invalid(j)]
    letters = set(
        DeadLetter.objects.filter(idempotency_key__in=invalid_keys).values_list(
            "idempotency_key", flat=True
        )
    )
    return {
        "counts": history.check(run),
        "times": times,
        "outage": (outage_start, outage_end),
        "invalid_once": sum(1 for k in invalid_keys if per_key[k] == 1 and k in letters),
        "invalid": len(invalid_keys),
        "states": watch.states,
        "openings": len(watch.openings),
        "unavailable": sum(1 for _, _, status in fake.requests if status == 503),
    }


def dispersion(times: list[float], start: float, end: float) -> float:
    """Variance over mean of the attempts per 100 ms bucket over [start, end), every
    bucket counted (reported, not asserted: the breaker's silence inflates it)."""
    n = max(1, math.ceil((end - start) / BUCKET))
    counts = Counter(int((t - start) / BUCKET) for t in times if start <= t < end)
    series = [counts.get(i, 0) for i in range(n)]
    mean = sum(series) / n
    if not mean:
        return 0.0
    return round(sum((c - mean) ** 2 for c in series) / n / mean, 2)


def outage_load(r: dict[str, Any]) -> float:
    """Attempts per second while the downstream is down, over attempts per second in the
    drain (outage end to last attempt): the share of the pace the workers showed they
    can sustain that was aimed at the sick downstream. The asserted statistic."""
    start, end = r["outage"]
    times = r["times"]
    during = sum(1 for t in times if start <= t < end)
    after = sum(1 for t in times if t >= end)
    drain = max(times[-1] - end, BUCKET) if after else BUCKET
    return round((during / (end - start)) / max(after / drain, 1e-9), 2)


LOAD_BOUND = 0.5  # jittered at most this; the storm above it


def breaker_cycled(r: dict[str, Any]) -> bool:
    """Opened, probed (seen half open, or re-opened by a failed probe), closed at the end."""
    states = r["states"]
    probed = "half_open" in states or r["openings"] >= 2
    return "open" in states and probed and states[-1] == "closed"


def breaker_path(r: dict[str, Any]) -> str:
    states = r["states"]
    return (
        f"{states.count('open')}x open, {states.count('half_open')}x half open "
        f"(probing), {r['openings']} openings, {states[-1] if states else '?'} at the end"
    )


def test_retry_storm(start_worker, queue, run_id, redis_client) -> None:
    started = time.monotonic()
    for _ in range(2):
        start_worker(concurrency=4)
    result = storm(CallDownstream(), run_id, queue, redis_client)
    # The control runs on the same workers, after the first storm has drained.
    control = storm(CallDownstreamStorm(), run_id + "c", queue, redis_client)
    for r in (result, control):
        end = r["times"][-1] + 1e-6
        # Outage start to the last attempt; the 2x bound's peak/mean over the non-empty
        # buckets, the dispersion over every bucket: both reported, neither asserted.
        r["storm"] = spread(r["times"], r["outage"][0], end)
        r["dispersion"] = dispersion(r["times"], r["outage"][0], end)
        r["load"] = outage_load(r)
    counts = result["counts"]
    valid = JOBS - result["invalid"]
    figures: dict[str, object] = {
        "outage load (asserted, <= 0.5)": result["load"],
        "attempts": len(result["times"]),
        "503 answers": result["unavailable"],
        "peak/100ms": result["storm"]["peak"],
        "mean/100ms (non-empty)": result["storm"]["mean"],
        "peak/mean (2x bound, not asserted)": result["storm"]["ratio"],
        "dispersion": result["dispersion"],
        "breaker": breaker_path(result),
        "4xx with 1 attempt + dead letter": f"{result['invalid_once']}/{result['invalid']}",
    }
    row = Row(
        scenario="retry storm",
        fault=f"downstream answers 503 for {OUTAGE} s over {JOBS} jobs (1 in 10 answered 400)",
        faults=result["unavailable"],  # 503 answers
        jobs=counts.jobs,
        lost=counts.lost,
        duplicates=counts.duplicates,
        figures=figures,
        holds=counts.lost == 0
        and counts.duplicates == 0
        and counts.done == valid
        and counts.dead_lettered == result["invalid"]
        and result["invalid_once"] == result["invalid"]
        and breaker_cycled(result)
        and result["load"] <= LOAD_BOUND,
        control=(
            f"no jitter, no breaker: outage load {control['load']}, "
            f"{control['unavailable']} answers 503; peak/mean per 100 ms "
            f"{control['storm']['ratio']}, dispersion {control['dispersion']}"
        ),
        control_failed=control["load"] > LOAD_BOUND,
        seconds=round(time.monotonic() - started, 1),
    )
    row.save()
    assert row.ok, row
