"""Metrics whose size and exposure are bounded, on real prefork workers scraped over HTTP.

- A worker with ``--max-tasks-per-child 1`` replaces its pool child after each job: the
  metrics directory keeps the same number of files whatever the number of jobs, and
  the scraped counters still add up to every job. Negative control: with only
  prometheus_client's ``mark_process_dead`` (the archive switched off by a wrapper),
  one more counter file per job.
- Messages for task names no worker knows, each name new: the scrape's series do not
  grow with the names; none of them appears.
- The worker's port listens on 127.0.0.1 by default, and with a token set answers only
  a request that carries it.
"""

from __future__ import annotations

import socket
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from celery_explicit import metrics, worker_metrics
from django_outbox.models import DeadLetter
from tests.support.ports import free_port
from tests.support.processes import ManagedProcess, project_env
from tests.support.waiting import wait_for
from tests.support.workers import Worker
from tests.testapp.models import Counter as CounterRow
from tests.testapp.tasks import Increment

WORKER = pytest.mark.worker
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
TOKEN = "scrape-token-h5"

#: Runs Celery's command line after one change: ``mark-only`` leaves dead children's
#: files to prometheus_client's ``mark_process_dead`` alone (the archive off);
#: ``token=<t>`` sets EXPLICIT_METRICS_TOKEN; ``-`` changes nothing.
WRAPPER = """
import sys
mode = sys.argv[1]
if mode == "mark-only":
    from prometheus_client.multiprocess import mark_process_dead
    from celery_explicit import worker_metrics
    worker_metrics.archive_dead = lambda directory, pid: mark_process_dead(pid, directory)
elif mode.startswith("token="):
    from django.conf import settings  # tests.settings, from DJANGO_SETTINGS_MODULE
    settings.EXPLICIT_METRICS_TOKEN = mode[len("token="):]
sys.argv = ["celery", *sys.argv[2:]]
from celery.__main__ import main
main()
"""


class RecyclingWorker(Worker):
    """A ``celery worker -c 1 --max-tasks-per-child 1``: a new pool child per job."""

    def __init__(
        self, *, queue: str, db_name: str, log_dir: Path, mode: str, extra_env: dict[str, str]
    ) -> None:
        self.queue = queue
        name = f"w{uuid.uuid4().hex[:6]}"
        # fmt: off
        command: Sequence[str] = [
            sys.executable, "-c", WRAPPER, mode, "-A", "tests.celery_app", "worker",
            "-Q", queue, "-c", "1", "-P", "prefork", "-n", f"{name}@%h",
            "--max-tasks-per-child", "1", "--without-gossip", "--without-mingle",
            "--without-heartbeat", "-l", "INFO",
        ]
        # fmt: on
        ManagedProcess.__init__(
            self,
            command,
            name=name,
            log_dir=log_dir,
            env=project_env(db_name=db_name, queue=queue, extra=extra_env),
        )


@pytest.fixture
def start_recycling(
    transactional_db: None, queue: str, tmp_path: Path, redis_client: redis.Redis
) -> Iterator[Callable[..., RecyclingWorker]]:
    from django.db import connection

    started: list[RecyclingWorker] = []

    def start(*, mode: str = "-", extra_env: dict[str, str]) -> RecyclingWorker:
        worker = RecyclingWorker(
            queue=queue,
            db_name=connection.settings_dict["NAME"],
            log_dir=tmp_path,
            mode=mode,
            extra_env=extra_env,
        )
        started.append(worker)
        return worker.wait_ready()

    yield start
    for worker in started:
        worker.stop()
    redis_client.delete(queue)


def metrics_env(port: int, directory: Path) -> dict[str, str]:
    return {"EXPLICIT_WORKER_METRICS_PORT": str(port), "EXPLICIT_METRICS_DIR": str(directory)}


def get(port: int, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(port: int, token: str | None = None) -> tuple[str, Samples]:
    status, text = get(port, token)
    assert status == 200, text
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return text, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie waiting for its parent's join."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def files_by_pid(directory: Path) -> dict[str, list[str]]:
    """The directory's metric files by the pid part of their name (or ``archive``)."""
    found: dict[str, list[str]] = {}
    for path in directory.glob("*.db"):
        found.setdefault(path.stem.rsplit("_", 1)[1], []).append(path.name)
    return found


def dead_files(directory: Path) -> list[str]:
    return [
        name
        for pid, names in files_by_pid(directory).items()
        if pid.isdigit() and not alive(int(pid))
        for name in names
    ]


def run_increments(worker: Worker, name: str, count: int, start: int) -> None:
    for i in range(start, start + count):
        Increment().apply_async(kwargs={"name": name, "op_id": f"j{i}"}, queue=worker.queue)


@WORKER
def test_replaced_children_leave_a_bounded_directory_and_every_count(
    start_recycling: Callable[..., RecyclingWorker], tmp_path: Path
) -> None:
    port, directory = free_port(), tmp_path / "metrics"
    worker = start_recycling(extra_env=metrics_env(port, directory))
    wait_for(lambda: listening(port), timeout=10, what="the metrics endpoint")
    CounterRow.objects.create(name="recycled")
    counted: dict[int, list[str]] = {}
    done = 0
    for total in (4, 16):
        run_increments(worker, "recycled", total - done, done)
        done = total
        wait_for(
            partial(lambda n: CounterRow.objects.get(name="recycled").value == n, total),
            timeout=60,
            what=f"{total} jobs",
            on_timeout=lambda: worker.log()[-3000:],
        )
        # Each job's child exits after it; the parent folds its files in once joined.
        wait_for(lambda: not dead_files(directory), timeout=20, what="dead children archived")
        _, samples = scrape(port)
        applied = "explicit_executions_total"
        assert value(samples, applied, task="tests.increment", outcome="applied") == total
        assert (
            value(samples, "explicit_attempt_duration_seconds_count", task="tests.increment")
            == total
        )
        by_pid = files_by_pid(directory)
        kinds = {name.rsplit("_", 1)[0] for names in by_pid.values() for name in names}
        # The live processes' files (the main one's, the current child's if it has
        # counted yet) and one archive per kind, however many children came and went.
        assert sum(map(len, by_pid.values())) <= 3 * len(kinds), by_pid
        counted[total] = sorted(by_pid.get("archive", []) + by_pid.get(str(worker.pid), []))
    # 16 jobs, 16 children: the same archive and main files as after 4.
    assert counted[16] == counted[4], counted


@WORKER
def test_control_mark_process_dead_alone_leaves_a_file_per_child(
    start_recycling: Callable[..., RecyclingWorker], tmp_path: Path
) -> None:
    port, directory = free_port(), tmp_path / "metrics"
    worker = start_recycling(mode="mark-only", extra_env=metrics_env(port, directory))
    wait_for(lambda: listening(port), timeout=10, what="the metrics endpoint")
    CounterRow.objects.create(name="kept")
    done = 0
    for total in (4, 12):
        run_increments(worker, "kept", total - done, done)
        done = total

        def applied() -> float:
            _, samples = scrape(port)
            return value(
                samples, "explicit_executions_total", task="tests.increment", outcome="applied"
            )

        wait_for(
            partial(lambda n: applied() == n, total),
            timeout=60,
            what=f"{total} jobs counted",
            on_timeout=lambda: worker.log()[-3000:],
        )
        # Each job ran in a child of its own, and each child's counter file stays.
        counter_files = [
            name
            for pid, names in files_by_pid(directory).items()
            if pid not in {"archive", str(worker.pid)}
            for name in names
            if name.startswith("counter_")
        ]
        assert len(counter_files) >= total, counter_files


@WORKER
def test_unknown_task_names_do_not_make_series(
    start_worker: Any, redis_client: redis.Redis, tmp_path: Path
) -> None:
    from tests.celery_app import app

    port = free_port()
    worker = start_worker(concurrency=1, extra_env=metrics_env(port, tmp_path / "metrics"))
    wait_for(lambda: listening(port), timeout=10, what="the metrics endpoint")
    names = [f"made.up.{uuid.uuid4().hex}" for _ in range(6)]

    def publish(batch: list[str], expected: int) -> tuple[str, Samples]:
        for name in batch:
            app.send_task(name, queue=worker.queue)
        wait_for(
            lambda: DeadLetter.objects.filter(task_name__startswith="made.up.").count() == expected,
            timeout=30,
            what=f"{expected} dead letters",
            on_timeout=lambda: worker.log()[-3000:],
        )
        return scrape(port)

    _, first = publish(names[:1], 1)
    text, after = publish(names[1:], len(names))

    def series(samples: Samples) -> set[frozenset[tuple[str, str]]]:
        return {labels for (name, labels) in samples if name == "explicit_dead_letters_total"}

    assert series(after) == series(first)
    unknown = [
        v
        for (name, labels), v in after.items()
        if name == "explicit_dead_letters_total" and ("task", "unknown") in labels
    ]
    assert sum(unknown) == len(names)
    for name in names:
        assert name not in text


def listening_addresses(port: int) -> set[str]:
    """The local addresses LISTENing on ``port`` (IPv4, from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


@WORKER
def test_the_worker_port_listens_on_loopback_and_asks_for_the_token(
    start_recycling: Callable[..., RecyclingWorker], tmp_path: Path
) -> None:
    port = free_port()
    start_recycling(mode=f"token={TOKEN}", extra_env=metrics_env(port, tmp_path / "metrics"))
    wait_for(lambda: listening(port), timeout=10, what="the metrics endpoint")
    assert listening_addresses(port) == {"127.0.0.1"}
    assert get(port)[0] == 401
    assert get(port, token=TOKEN + "x")[0] == 403
    assert get(port, token="")[0] == 403
    assert get(port, token=TOKEN)[0] == 200


def test_serve_answers_by_the_token_setting(settings: Any) -> None:
    """``serve`` (the relay's port too) reads the token at each request."""
    registry = CollectorRegistry()
    Counter("h5_served_total", "A counter to serve.", registry=registry).inc()
    port = free_port()
    settings.EXPLICIT_METRICS_TOKEN = ""
    httpd = worker_metrics.serve(registry, port=port, bind="127.0.0.1")
    try:
        assert listening_addresses(port) == {"127.0.0.1"}
        status, text = get(port)
        assert status == 200 and "h5_served_total 1.0" in text
        settings.EXPLICIT_METRICS_TOKEN = TOKEN
        assert get(port)[0] == 401
        assert get(port, token="nope")[0] == 403
        assert get(port, token=TOKEN)[0] == 200
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_lock_families_beyond_the_cap_count_as_other(monkeypatch: Any) -> None:
    monkeypatch.setattr(metrics, "_lock_families", set())
    labels = {metrics.lock_label(f"user-{i}") for i in range(metrics.MAX_LOCK_FAMILIES * 3)}
    assert len(labels) == metrics.MAX_LOCK_FAMILIES + 1
    assert metrics.OTHER_LOCKS in labels
    assert metrics.lock_label("user-0") == "user-0"  # one seen before the cap keeps its name


def test_task_labels_are_registered_names(monkeypatch: Any) -> None:
    assert metrics.task_label("tests.increment") == "tests.increment"
    assert metrics.task_label(f"made.up.{uuid.uuid4().hex}") == metrics.UNKNOWN_TASK
    assert metrics.task_label(None) == metrics.UNKNOWN_TASK
    child = metrics.dead_letters.labels(task="made.up.x", reason="unknown")
    assert child is metrics.dead_letters.labels("unknown", "unknown")
