"""The business writes of the broker scenarios (restarts, outage): a producer in the
test process that, per job, commits the business row (``chaos_publish``) and hands the
job (``tasks.ChaosJob``) to the broker one of three ways; a sampler of the outbox
backlog; a supervisor that restarts workers.

- ``outbox``: ``dispatch(durable=True)`` in the business transaction; the relay
  publishes. The broker may be down: the row waits in the outbox.
- ``on_commit``: ``dispatch(durable=False)``; the publish runs after the commit and a
  failure is logged and counted, never raised (the job is lost, the row stays).
- ``after_commit``: the transaction commits, then a bare ``apply_async``; a failure is
  caught and logged, as careless code does (the job is lost, the row stays).

The two controls publish to the scenario's private broker with neither Celery's publish
retries nor kombu's connection retries: an outage must fail them at once instead of
hanging the producer (a retry only moves the loss to a longer outage).

The private broker (``BROKERS``) is a Redis with appendonly and fsync always
(``redis``) or a RabbitMQ node whose queues are quorum queues and whose publishers wait
for confirms (``rabbitmq-quorum``): either keeps what it acknowledged through a SIGKILL.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from django.db import connection, transaction
from django.utils import timezone
from kombu import Connection, Exchange, Queue

from django_outbox.models import OutboxEvent
from django_outbox.outbox.dispatch import dispatch
from tests.chaos import history
from tests.chaos.tasks import ChaosJob

HOWS = ("outbox", "on_commit", "after_commit")
BROKERS = ("redis", "rabbitmq-quorum")


@dataclass
class Producer:
    run: str
    queue: str
    broker_url: str
    how: str
    #: The broker's queues are RabbitMQ quorum queues (publish with confirms).
    quorum: bool = False
    #: Writes attempted; job numbers are 0 .. attempted - 1.
    attempted: int = 0
    #: Business transactions that raised (must stay 0: the broker is not the business's).
    commit_errors: list[str] = field(default_factory=list)
    #: Publishes that raised after the commit (``after_commit`` only; ``on_commit``
    #: failures are logged by dispatch() and not seen here).
    publish_errors: int = 0

    def __post_init__(self) -> None:
        assert self.how in HOWS, self.how

    def write(self) -> None:
        job = self.attempted
        self.attempted += 1
        kwargs = {"run": self.run, "job": job}
        try:
            if self.how == "outbox":
                with transaction.atomic():
                    history.record_published(self.run, [job])
                    dispatch(ChaosJob(), kwargs=kwargs, durable=True, options={"queue": self.queue})
            elif self.how == "on_commit":
                with self._connection() as conn, transaction.atomic():
                    history.record_published(self.run, [job])
                    dispatch(
                        ChaosJob(),
                        kwargs=kwargs,
                        options={"queue": self._target(), "retry": False, "connection": conn},
                    )
            else:
                with transaction.atomic():
                    history.record_published(self.run, [job])
                self._publish_and_shrug(kwargs)
        except Exception as exc:  # counted: the invariant is that none happens
            self.commit_errors.append(f"job {job}: {exc!r}")

    def committed(self) -> int:
        """Business rows committed for this producer's run."""
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM chaos_publish WHERE run = %s", [self.run])
            return int(cursor.fetchone()[0])

    def _publish_and_shrug(self, kwargs: dict[str, object]) -> None:
        try:
            with self._connection() as conn:
                ChaosJob().apply_async(
                    kwargs=kwargs, queue=self._target(), connection=conn, retry=False
                )
        except Exception:
            # The careless pattern the control stands for: log and carry on.
            self.publish_errors += 1

    def _connection(self) -> Connection:
        # A new connection per publish: one broken by a restart is not reused.
        return Connection(
            self.broker_url,
            connect_timeout=0.5,
            transport_options={"max_retries": 0, "confirm_publish": self.quorum},
        )

    def _target(self) -> str | Queue:
        """The queue a control publishes to. On quorum queues, declared as the workers
        declare it: RabbitMQ refuses a classic declare of a quorum queue
        (PRECONDITION_FAILED), which would lose the job with the broker up."""
        if not self.quorum:
            return self.queue
        return Queue(
            self.queue,
            Exchange(self.queue),
            self.queue,
            queue_arguments={"x-queue-type": "quorum"},
        )


def done_below(run: str, jobs: int) -> int:
    """Jobs ``0 .. jobs - 1`` of ``run`` whose effect was applied."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(DISTINCT job) FROM chaos_effect WHERE run = %s AND job < %s",
            [run, jobs],
        )
        return int(cursor.fetchone()[0])


@dataclass
class Backlog:
    """The outbox backlog, sampled: its peak, and after the broker came back
    (``broker_back()``), how long until the events written before that were relayed
    (``relayed_after``) and their jobs' effects applied (``applied_after``)."""

    run: str
    peak: int = 0
    back_at: float | None = None
    back_at_wall: datetime.datetime | None = None
    #: Jobs of ``run`` written before the broker came back.
    jobs_before: int = 0
    relayed_after: float | None = None
    applied_after: float | None = None

    def broker_back(self, jobs_before: int, *, at: float | None = None) -> None:
        """The broker is back since ``at`` (``time.monotonic()``; default now)."""
        self.back_at = time.monotonic() if at is None else at
        self.back_at_wall = timezone.now()
        self.jobs_before = jobs_before
        self.relayed_after = self.applied_after = None

    def sample(self) -> int:
        pending = OutboxEvent.objects.pending()
        count = pending.count()
        self.peak = max(self.peak, count)
        if self.back_at is None:
            return count
        elapsed = time.monotonic() - self.back_at
        if (
            self.relayed_after is None
            and not pending.filter(created_at__lte=self.back_at_wall).exists()
        ):
            self.relayed_after = elapsed
        if self.applied_after is None and (
            done_below(self.run, self.jobs_before) >= self.jobs_before
        ):
            self.applied_after = elapsed
        return count

    def settled(self, outbox: Producer) -> bool:
        """Nothing pending in the outbox, and every job ``outbox`` wrote applied (the
        figures sampled on the way)."""
        self.sample()
        return (
            self.relayed_after is not None
            and self.applied_after is not None
            and not OutboxEvent.objects.pending().exists()
            and history.done_count(outbox.run) >= outbox.attempted
        )


@dataclass
class OutboxRig:
    """The broker scenarios' set-up: a private broker (``BROKERS``), two supervised
    workers and two relays on it, a producer writing through the outbox and a control
    producer writing the other way, and the backlog they leave."""

    broker: Any
    workers: Supervisor
    relays: list[Any]
    outbox: Producer
    control: Producer
    backlog: Backlog


@contextmanager
def outbox_rig(
    start_worker: Any,
    start_relay: Any,
    *,
    run: str,
    queue: str,
    tmp_path: Path,
    control_path: str,
    relay_args: tuple[str, ...],
    broker: str = "redis",
) -> Iterator[OutboxRig]:
    """Start the rig on a private ``broker`` (one of ``BROKERS``); on the way out the
    workers are stopped (no replacements, then a warm shutdown while the broker is
    still up) and the broker killed, whatever happened."""
    from tests.support.rabbitmq import PrivateRabbitMQ
    from tests.support.servers import PrivateRedis

    assert broker in BROKERS, broker
    quorum = broker == "rabbitmq-quorum"
    server: PrivateRedis | PrivateRabbitMQ = (
        PrivateRabbitMQ(tmp_path / "broker")
        if quorum
        else PrivateRedis(tmp_path / "broker", durable=True)
    )
    server.start()
    # Celery declares the workers' and relays' queue as a quorum queue, and the relays
    # publish with confirms (tests/settings.py).
    env = {"EXPLICIT_TEST_QUEUE_TYPE": "quorum"} if quorum else {}
    workers: Supervisor | None = None
    try:
        workers = Supervisor(
            start_worker,
            count=2,
            env={"EXPLICIT_TEST_BROKER_URL": server.url, **env},
            concurrency=2,
            broker_up=server.ping,
        )
        workers.start()
        # start_relay passes the broker URL only; the relays' environment is the test
        # process's otherwise.
        with mock.patch.dict(os.environ, env):
            relays = [start_relay(*relay_args, broker_url=server.url) for _ in range(2)]
        yield OutboxRig(
            broker=server,
            workers=workers,
            relays=relays,
            outbox=Producer(run, queue, server.url, "outbox", quorum=quorum),
            control=Producer(run + "c", queue, server.url, control_path, quorum=quorum),
            backlog=Backlog(run),
        )
    finally:
        if workers is not None:
            workers.stop(reraise=False)
            for worker in workers.workers:
                worker.stop()
        server.kill()


class Supervisor(threading.Thread):
    """Keeps ``count`` workers on the scenario's broker running, as systemd's
    ``Restart=always`` or a Kubernetes Deployment would: a worker that exits is replaced.

    They do exit: Celery 5.7.0's consumer, on losing a Redis broker while it holds
    unacked messages, collects the connection and then closes it; the close restores
    the unacked messages through a transport whose client is gone, and the
    ``AttributeError`` ("'NoneType' object has no attribute 'hostname'") is an
    "Unrecoverable error" that stops the worker. ``crashes`` counts them.
    """

    def __init__(
        self,
        start_worker: Callable[..., Any],
        *,
        count: int,
        env: dict[str, str],
        concurrency: int,
        broker_up: Callable[[], bool],
    ) -> None:
        super().__init__(daemon=True)
        self._broker_up = broker_up
        self._start_worker = start_worker
        self._concurrency = concurrency
        self._env = env
        self.workers = [self._start() for _ in range(count)]
        self.crashes = 0
        self.crash_logs: list[str] = []
        self.error: BaseException | None = None
        self._stopping = threading.Event()

    def _start(self) -> Any:
        return self._start_worker(concurrency=self._concurrency, extra_env=self._env)

    def run(self) -> None:
        try:
            while not self._stopping.wait(0.5):
                for worker in list(self.workers):
                    # A replacement is ready only once connected: start it when the
                    # broker answers, not to wait out an outage in start_worker().
                    if worker.alive() or not self._broker_up():
                        continue
                    self.crashes += 1
                    self.crash_logs.append(worker.log()[-3000:])
                    self.workers.remove(worker)
                    self.workers.append(self._start())
        except BaseException as exc:  # re-raised by the test's thread (stop())
            self.error = exc

    def stop(self, *, reraise: bool = True) -> None:
        """Stop replacing workers (they keep running; the fixture stops them)."""
        self._stopping.set()
        if self.is_alive():
            self.join()
        if reraise and self.error is not None:
            raise self.error
