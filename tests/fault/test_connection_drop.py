"""A worker's connections to Redis drop for a while as it runs a job (Redis broker).

Worker A reaches Redis (broker and state) through a proxy; worker B, on the same queue,
directly. A takes a 14 s job whose task leases 10 s (``HoldsTheLine``), and 2 s into it
every connection of A is closed and new ones are refused for a while: its heartbeat
cannot extend anything, its consumer reconnects when the proxy lets it.

- A cut shorter than the lease: the heartbeat resumes after the reconnect, the lease
  never runs out, the job starts once and is applied once.
- A cut longer than the lease: the lease runs out, B takes the job over (a second
  start, which nothing can avoid when the holder is unreachable), and the job is still
  applied exactly once, with nothing left on the broker.

The negative control is the short cut with the heartbeat off on A
(``EXPLICIT_LEASE_EXTEND=0``): the lease runs out mid-job and the job is started again,
so the rounds can see a second start when there is one. Every round of it shows one,
and a round may show a third: once the lease has lapsed, more than one copy of the
message can be about (the sweep's copy goes to whichever consumer asks first, A's own
in about half the rounds at full scale, by the ``pids`` of the starts). The job is
applied once either way.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kombu import Connection

from django_outbox.models import ProcessedOperation
from tests.support.proxy import CuttableProxy
from tests.support.scale import scaled
from tests.support.servers import PrivateRedis
from tests.support.waiting import wait_for
from tests.testapp.models import Counter
from tests.testapp.tasks import HoldsTheLine

pytestmark = [
    pytest.mark.worker,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(600),
]

ROUNDS = scaled(1, 10)  # 10 under scripts/chaos (full scale)
SECONDS = 14.0  # the job; its lease is 10 s
CUT_AFTER = 2.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[PrivateRedis]:
    private = PrivateRedis(tmp_path / "redis", durable=False).start()
    yield private
    private.kill()


def one_round(
    start_worker, server: PrivateRedis, queue: str, cut: float, a_env: dict[str, str]
) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """One job on a queue of its own, A and B on it and stopped after it."""
    started_client = redis.Redis(port=server.port, db=1)  # the workers' state Redis
    proxy = CuttableProxy(("127.0.0.1", server.port))
    try:
        op = uuid.uuid4().hex[:8]
        Counter.objects.create(name=op)
        direct = {
            "EXPLICIT_TEST_BROKER_URL": server.url,
            "EXPLICIT_TEST_REDIS_URL": f"redis://127.0.0.1:{server.port}/1",
        }
        proxied = {
            "EXPLICIT_TEST_BROKER_URL": proxy.url(0),
            "EXPLICIT_TEST_REDIS_URL": proxy.url(1),
        }
        a = start_worker(queue=queue, concurrency=1, extra_env={**proxied, **a_env})
        with Connection(server.url) as conn:
            HoldsTheLine().apply_async(
                kwargs={"name": op, "op_id": op, "seconds": SECONDS}, queue=a.queue, connection=conn
            )
        wait_for(lambda: started_client.llen(f"started:{op}"), timeout=20, what="the first start")
        b = start_worker(queue=queue, concurrency=1, extra_env=direct)
        time.sleep(CUT_AFTER)
        closed = proxy.cut(cut)
        # The effect's ledger row, not an ``applied`` attempt: when A's commit lands
        # before B's takeover (a slow machine delays the takeover), A's handler then
        # fails on its own Redis write after the effect (the cut is still on), and B's
        # copy finds the effect done: the job is applied once with no ``applied`` row.
        wait_for(
            lambda: ProcessedOperation.objects.filter(key=f"line:{op}:{op}").exists(),
            timeout=SECONDS + cut + 60,
            what="the job applied",
        )
        broker = server.client()
        # Nothing left on the broker: acked by whoever holds it, or it would come back.
        wait_for(
            lambda: not broker.hlen("unacked") and not broker.llen(a.queue),
            timeout=SECONDS + 30,
            what="the broker's records gone",
            on_timeout=lambda: (broker.hgetall("unacked"), a.log()[-3000:]),
        )
        time.sleep(1)
        result = {
            "starts": started_client.llen(f"started:{op}"),
            "pids": [int(x) for x in started_client.lrange(f"started:{op}", 0, -1)],
            "spans": [x.decode() for x in started_client.lrange(f"spans:{op}", 0, -1)],
            "effect": Counter.objects.get(name=op).value,
            "closed": closed,
            "a_alive": a.alive(),
            "b_alive": b.alive(),
        }
        a.stop()
        b.stop()
        return result
    finally:
        proxy.close()


@pytest.mark.parametrize(
    ("cut", "lease_extend", "starts"),
    [(3.0, "1", {1}), (13.0, "1", {1, 2}), (3.0, "0", {2, 3})],
    ids=["cut-shorter-than-the-lease", "cut-longer-than-the-lease", "negative-control"],
)
def test_a_worker_cut_off_from_redis_mid_job_applies_it_once(
    start_worker, server, queue, cut, lease_extend, starts
) -> None:
    env = {"EXPLICIT_LEASE_EXTEND": lease_extend}
    results = [one_round(start_worker, server, f"{queue}-{n}", cut, env) for n in range(ROUNDS)]
    print(results)
    assert all(r["closed"] for r in results)  # the cut met open connections
    assert [r["effect"] for r in results] == [1] * ROUNDS
    assert {r["starts"] for r in results} <= starts
    if lease_extend == "0":
        assert min(r["starts"] for r in results) >= 2  # every round ran it again
