"""A worker killed while it takes a message off its queue: the message is kept (Redis).

kombu's ``BRPOP`` hands a message to the worker's connection and removes it from the
queue in one step; the worker records it as delivered in another, once it has read
the reply. A worker killed between the two lost the message: the short kill storm
lost a job so about once in 20 runs. ``celery_explicit.atomic_fetch`` takes and
records it in one script, and waits for a message with a command that takes nothing.

The history lands every kill in that moment instead of hoping for it: a worker idle on
a queue of its own is stopped (SIGSTOP) while the server shows its consumer's
connection blocked in its wait, a job is published to that queue (the server answers
the blocked connection at once), and the worker is killed whole (SIGKILL) without
having read the answer. Each round then looks at the broker: the job must be on its
queue or in ``unacked``, never nowhere. A worker started on every queue at the end
applies each job kept exactly once.

The broker is a private ``redis-server``: only this test's workers are connected to
it, so ``CLIENT LIST`` names theirs. The negative control (``EXPLICIT_ATOMIC_FETCH=0``,
kombu's ``BRPOP``) loses the job of every round whose wait the publish met.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import redis
from kombu import Connection

from tests.support.scale import scaled
from tests.support.servers import PrivateRedis
from tests.support.waiting import wait_for
from tests.support.workers import Worker
from tests.testapp.models import Counter
from tests.testapp.tasks import SlowShip

pytestmark = [
    pytest.mark.worker,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(300),
]

ROUNDS = scaled(6, 20)  # 20 under scripts/chaos (full scale)
#: The commands a consumer waits in: kombu's, and the atomic fetch's.
WAITS = {"brpop", "blmove"}


@dataclass
class Round:
    queue: str
    order: str
    waited_in: str | None  # the command the worker was blocked in when published
    kept: bool | None = None  # on its queue or in unacked after the kill


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path / "broker", durable=False).start()
    yield server
    server.kill()


def blocked_in(client: redis.Redis, pid: int) -> str | None:
    """The command the worker ``pid`` is blocked in on this server (its consumer's
    connection, found by its local port), or None."""
    ports = {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.raddr}
    for entry in client.client_list():
        port = int(str(entry["addr"]).rsplit(":", 1)[1])
        if port in ports and "b" in str(entry["flags"]) and entry["cmd"] in WAITS:
            return str(entry["cmd"])
    return None


def history(
    start_worker: Callable[..., Worker], broker: PrivateRedis, queue: str, atomic: bool
) -> list[Round]:
    env = {"EXPLICIT_TEST_BROKER_URL": broker.url, "EXPLICIT_ATOMIC_FETCH": str(int(atomic))}
    client = broker.client()
    rounds: list[Round] = []
    with Connection(broker.url) as publisher:
        for number in range(ROUNDS):
            victim = start_worker(queue=f"{queue}-{number}", concurrency=1, extra_env=env)
            order = uuid.uuid4().hex[:8]
            Counter.objects.create(name=order)
            pid = victim.pid
            wait_for(lambda pid=pid: blocked_in(client, pid), timeout=20, what="its wait")
            os.killpg(victim.pid, signal.SIGSTOP)
            # Stopped: it sends nothing more. Published while the server still holds its
            # wait open (a wait lasts up to a second), the job is answered to it at once.
            waited_in = blocked_in(client, victim.pid)
            SlowShip().apply_async(
                args=[order, order, 0.1], queue=victim.queue, connection=publisher
            )
            time.sleep(0.05)  # the server answers the blocked connection
            os.killpg(victim.pid, signal.SIGKILL)
            victim.process.wait(10)
            held = [entry for entry in client.hvals("unacked") if order.encode() in entry]
            rounds.append(
                Round(victim.queue, order, waited_in, bool(client.llen(victim.queue) or held))
            )
    return rounds


def apply_kept(
    start_worker: Callable[..., Worker], broker: PrivateRedis, rounds: list[Round]
) -> dict[str, int]:
    """Start a worker on every queue; wait until each kept job has its effect."""
    env = {"EXPLICIT_TEST_BROKER_URL": broker.url}
    start_worker(queue=",".join(r.queue for r in rounds), concurrency=2, extra_env=env)
    kept = [r.order for r in rounds if r.kept]
    wait_for(
        lambda: Counter.objects.filter(name__in=kept, value__gte=1).count() == len(kept),
        timeout=60,
        what="every kept job's effect",
    )
    return dict(
        Counter.objects.filter(name__in=[r.order for r in rounds]).values_list("name", "value")
    )


def test_a_worker_killed_as_it_takes_a_message_leaves_the_message_on_the_broker(
    start_worker, broker, queue
) -> None:
    rounds = history(start_worker, broker, queue, atomic=True)
    tested = [r for r in rounds if r.waited_in]
    waits = [r.waited_in for r in rounds]
    print(f"{len(rounds)} rounds, {len(tested)} published into a wait: {waits}")
    assert len(tested) >= ROUNDS // 2  # the kill landed where it was meant to
    assert {r.waited_in for r in tested} == {"blmove"}  # the fetch's wait, not a BRPOP
    assert [r.order for r in rounds if not r.kept] == []
    # Time for a job recorded in unacked to come back (its 2 s lease, a sweep).
    values = apply_kept(start_worker, broker, rounds)
    assert values == {r.order: 1 for r in rounds}  # every job applied, once


def test_negative_control_kombu_s_brpop_loses_the_message_of_a_killed_worker(
    start_worker, broker, queue
) -> None:
    rounds = history(start_worker, broker, queue, atomic=False)
    tested = [r for r in rounds if r.waited_in]
    lost = [r for r in tested if not r.kept]
    print(f"{len(rounds)} rounds, {len(tested)} published into a BRPOP, {len(lost)} lost")
    assert len(tested) >= ROUNDS // 2
    assert {r.waited_in for r in tested} == {"brpop"}
    assert len(lost) == len(tested)  # every job handed to a BRPOP of a dead worker is gone
    values = apply_kept(start_worker, broker, rounds)
    assert all(values[r.order] == 0 for r in lost)  # not on the broker: nobody can apply it
