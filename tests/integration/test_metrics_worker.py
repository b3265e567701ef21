"""The worker's metrics endpoint on real prefork workers, scraped over HTTP.

What a pool child counts must reach the one endpoint the main process serves: both
children of ``--concurrency 2``, and a child that died. The causes are the real ones:
a lease that ran out while its holder was stopped (SIGSTOP) is a redelivery with cause
``lease_expired`` in the child that took the job over, and the stale holder's commit,
refused, a fenced commit in the other; a message delivered twice is an idempotency
conflict of kind ``duplicate``. The negative controls: with the setting off nothing
listens; a directory that cannot be written leaves the worker running, off, saying
why in one line.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from django_outbox.models import Attempt, DeadLetter, Outcome
from tests.support.ports import free_port
from tests.support.processes import ROOT
from tests.support.waiting import wait_for
from tests.testapp.models import Counter, OrderState, Profile
from tests.testapp.tasks import Increment, KillsItsWorker, ShipToAddress

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> tuple[str, Samples]:
    """The endpoint's exposition, and every sample in it by (name, labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return text, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def metrics_env(port: int, directory: Path) -> dict[str, str]:
    return {"EXPLICIT_WORKER_METRICS_PORT": str(port), "EXPLICIT_METRICS_DIR": str(directory)}


def test_both_pool_children_are_served_with_the_right_causes(
    start_worker: Any, redis_client: Any, tmp_path: Path
) -> None:
    port = free_port()
    worker = start_worker(concurrency=2, extra_env=metrics_env(port, tmp_path / "metrics"))
    wait_for(lambda: listening(port), timeout=10, what="the metrics endpoint")
    ship = "tests.ship_to_address"
    _, before = scrape(port)
    assert value(before, "explicit_redeliveries_total", task=ship, cause="lease_expired") == 0

    # A holder stopped past its lease: the other child takes the job over (a redelivery,
    # cause lease_expired); the holder, woken up, has its commit refused (fenced).
    tag = uuid.uuid4().hex[:8]
    Profile.objects.create(user_id=1, data="old address")
    ShipToAddress().apply_async(args=[1, tag], queue=worker.queue)
    stale_pid = int(wait_for(lambda: redis_client.lindex(f"started:{tag}", 0), timeout=20))
    os.kill(stale_pid, signal.SIGSTOP)
    redis_client.set(f"stopped:{tag}", 1, ex=60)
    try:
        wait_for(lambda: redis_client.llen(f"started:{tag}") == 2, timeout=20, what="takeover")
    finally:
        os.kill(stale_pid, signal.SIGCONT)
    redis_client.set(f"proceed:{tag}", 1, ex=60)
    wait_for(
        lambda: Attempt.objects.filter(idempotency_key="ship:1").count() == 2,
        timeout=20,
        what="both executions' attempts",
        on_timeout=lambda: worker.log()[-3000:],
    )
    assert Attempt.objects.get(idempotency_key="ship:1", outcome=Outcome.FENCED)
    assert OrderState.objects.count() == 1

    # The same job delivered twice: the second finds its key in the ledger.
    Counter.objects.create(name="dup")
    for _ in range(2):
        Increment().apply_async(kwargs={"name": "dup", "op_id": "op-secret-1"}, queue=worker.queue)
    wait_for(
        lambda: Attempt.objects.filter(idempotency_key="counter:dup:op:op-secret-1").count() == 2,
        timeout=20,
        what="both deliveries' attempts",
    )

    text, after = scrape(port)
    assert value(after, "explicit_redeliveries_total", task=ship, cause="lease_expired") == 1
    assert value(after, "explicit_fenced_commits_total", task=ship) == 1
    conflicts = "explicit_idempotency_conflicts_total"
    assert value(after, conflicts, task="tests.increment", kind="duplicate") == 1
    # Counted in two processes (the holder and the one that took over), served by one.
    attempts = Attempt.objects.filter(idempotency_key="ship:1")
    assert len(set(attempts.values_list("worker_pid", flat=True))) == 2
    assert value(after, "explicit_executions_total", task=ship, outcome="fenced") == 1
    assert value(after, "explicit_executions_total", task=ship, outcome="applied") == 1
    # Histograms from the pool too: one attempt duration per attempt row.
    assert value(after, "explicit_attempt_duration_seconds_count", task=ship) == 2
    # Queue wait: one per delivery that ran (both of the ship job's, both duplicates).
    assert value(after, "explicit_queue_wait_seconds_count", task=ship) == 2
    assert value(after, "explicit_queue_wait_seconds_count", task="tests.increment") == 2
    # Attempts per job: once per job that ended (the fenced execution did not end it).
    assert value(after, "explicit_attempts_per_job_count", task=ship) == 1
    assert value(after, "explicit_attempts_per_job_sum", task=ship) == 1
    # No argument, payload or key in a label or anywhere in the exposition.
    for secret in ("op-secret-1", "counter:dup", "ship:1", "old address", tag):
        assert secret not in text


SWITCH_THEN_FORK = """
import os, sys
from django_outbox.cache import stats
from django_outbox.outbox.relay import metrics as relay_metrics
from celery_explicit import worker_metrics

counts = stats.Counts("profiles")  # children bound before the switch, as at import
worker_metrics.switch_to_files(sys.argv[1])
children = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        relay_metrics.broker_unavailable.inc()  # unlabeled: created at import
        relay_metrics.publish_lag.observe(0.2)
        counts.add("hits")
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
"""


def test_metrics_created_before_the_switch_count_in_files(tmp_path: Path) -> None:
    """Unlabeled metrics (created at import) and children bound before worker start
    count in files once switched: each of two forked processes' counts is merged."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    directory = tmp_path / "metrics"
    directory.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    subprocess.run(
        [sys.executable, "-c", SWITCH_THEN_FORK, str(directory)], env=env, check=True, timeout=30
    )
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    got = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in registry.collect()
        for s in family.samples
    }
    assert got[("explicit_outbox_broker_unavailable_total", frozenset())] == 2
    assert got[("explicit_outbox_publish_lag_seconds_count", frozenset())] == 2
    hits = frozenset({"cache": "profiles", "outcome": "hit"}.items())
    assert got[("explicit_cache_reads_total", hits)] == 2


def test_a_dead_childs_counts_stay(start_worker: Any, redis_client: Any, tmp_path: Path) -> None:
    port = free_port()
    worker = start_worker(concurrency=1, extra_env=metrics_env(port, tmp_path / "metrics"))
    wait_for(lambda: listening(port), timeout=10, what="the metrics endpoint")
    Counter.objects.create(name="kept")
    for i in range(3):
        Increment().apply_async(kwargs={"name": "kept", "op_id": f"k{i}"}, queue=worker.queue)
    wait_for(lambda: Counter.objects.get(name="kept").value == 3, timeout=20, what="3 increments")
    first_child = worker.child_pids()
    # A poison message kills its pool process on each delivery until the delivery limit.
    KillsItsWorker().apply_async(args=["poison"], queue=worker.queue)
    wait_for(
        lambda: DeadLetter.objects.filter(task_name="tests.kills_its_worker").exists(),
        timeout=60,
        what="the poison's dead letter",
        on_timeout=lambda: worker.log()[-3000:],
    )
    assert not set(first_child) & set(worker.child_pids())  # the child that counted is gone
    _, samples = scrape(port)
    increment, poison = "tests.increment", "tests.kills_its_worker"
    assert value(samples, "explicit_executions_total", task=increment, outcome="applied") == 3
    assert value(samples, "explicit_dead_letters_total", task=poison, reason="delivery_limit") == 1
    assert value(samples, "explicit_redeliveries_total", task=poison, cause="holder_dead") >= 1


def test_off_nothing_listens(start_worker: Any, tmp_path: Path) -> None:
    port = free_port()
    worker = start_worker(extra_env={"EXPLICIT_METRICS_DIR": str(tmp_path / "metrics")})
    Counter.objects.create(name="off")
    Increment().apply_async(kwargs={"name": "off", "op_id": "1"}, queue=worker.queue)
    wait_for(lambda: Counter.objects.get(name="off").value == 1, timeout=20, what="the job")
    assert not listening(port)
    assert "worker metrics" not in worker.log()
    assert not (tmp_path / "metrics").exists()


def test_an_unwritable_directory_says_why_once_and_the_worker_runs(
    start_worker: Any, tmp_path: Path
) -> None:
    port = free_port()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    # A directory under a regular file can never be created, whoever runs the test (as
    # root, a read-only mode would not stop the write).
    worker = start_worker(extra_env=metrics_env(port, blocker / "metrics"))
    Counter.objects.create(name="runs")
    Increment().apply_async(kwargs={"name": "runs", "op_id": "1"}, queue=worker.queue)
    wait_for(lambda: Counter.objects.get(name="runs").value == 1, timeout=20, what="the job")
    said = [line for line in worker.log().splitlines() if "worker metrics" in line]
    assert len(said) == 1, said
    assert "cannot be written" in said[0] and str(blocker / "metrics") in said[0]
    assert "EXPLICIT_METRICS_DIR" in said[0]
    assert not listening(port)
