"""Worker hosts in network namespaces of their own; the link of the host running a
job is cut mid-task for longer than the job's lease, then restored, many times.

Must hold: the job finishes on another host while the first is cut off; the cut-off
host's commit is refused when its link returns (its attempt ``fenced``); 0 duplicate
effects, every job done. Negative control: the same rounds with the execution lease
off (``EXPLICIT_EXECUTION_LEASE=0``): the stale host's write lands, a duplicate effect.

The network (tests/chaos/netns.py): a "services" namespace running a private Redis
(broker and state) and a private PostgreSQL cluster, one namespace per worker host,
one veth pair from each to the services, one from the root namespace (where the test
publishes and reads the history through ``tests.chaos.tasks_hosts.serve``). A cut
takes the services end of the host's link down: the host's sockets see silence, as on
a real partition. Needs root (``ip netns``): CI runs as root.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter as Tally
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.chaos import netns
from tests.chaos.report import Row, scaled
from tests.chaos.tasks_hosts import CLIENT, HOST_ENV, HostJob
from tests.support.private_postgres import PG_BIN
from tests.support.processes import ROOT, ManagedProcess, project_env
from tests.support.waiting import wait_for

ROUNDS = scaled(3, 20)
# Each round waits out a cut past the lease (about 10 s with the takeover and the
# stale host's return), twice over (the negative control).
pytestmark = [pytest.mark.worker, pytest.mark.timeout(scaled(240, 1800))]

HOSTS = ["a", "b"]
DB_NAME = "chaos_hosts"
LEASE = HostJob.visibility_timeout
#: The cut lasts at least this long: past the lease, whatever the takeover took.
CUT = LEASE + 2.0


@dataclass
class Services:
    """The private services, the workers per variant, and the test's client."""

    net: netns.Topology
    tmp: Path
    queue: str
    processes: list[ManagedProcess] = field(default_factory=list)

    def env(self, host: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        address = self.net.services_ip(host)
        return project_env(
            db_name=DB_NAME,
            queue=self.queue,
            extra={
                "PGHOST": address,
                "PGPORT": "5432",
                "PGUSER": "postgres",
                "EXPLICIT_TEST_REDIS_URL": f"redis://{address}:6379/0",
                "EXPLICIT_TEST_BROKER_URL": f"redis://{address}:6379/0",
                "EXPLICIT_TEST_CACHE_URL": f"redis://{address}:6379/1",
                **(extra or {}),
            },
        )

    def start(self, command: list[str], *, name: str, ready: str, role: str, env: Any = None):  # type: ignore[no-untyped-def]
        process = ManagedProcess(
            [*self.net.prefix(role), *command],
            name=name,
            log_dir=self.tmp,
            env=env,
            ready=ready,
        )
        self.processes.append(process)
        return process.wait_ready(timeout=90)

    def redis(self) -> redis.Redis:
        return redis.Redis(host=self.net.services_ip(netns.ROOT), port=6379, db=0)


@contextlib.contextmanager
def services() -> Iterator[Services]:
    before = netns.namespaces()
    # Not pytest's tmp_path: the postgres user must reach the cluster's directory.
    tmp = Path(tempfile.mkdtemp(prefix="ce-hosts-"))
    tmp.chmod(0o755)
    net = netns.Topology.create(HOSTS)
    env = Services(net=net, tmp=tmp, queue=f"hosts-{uuid.uuid4().hex[:8]}")
    try:
        env.start(
            [
                "redis-server", "--bind", "0.0.0.0", "--port", "6379", "--save", "",
                "--appendonly", "no", "--protected-mode", "no", "--dir", str(tmp),
            ],
            name="redis",
            ready="Ready to accept connections",
            role=netns.SERVICES,
        )  # fmt: skip
        data = tmp / "pg"
        data.mkdir()
        shutil.chown(data, "postgres", "postgres")
        as_postgres = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]
        subprocess.run(
            [*as_postgres, str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U",
             "postgres", "--no-sync"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        with (data / "pg_hba.conf").open("a") as hba:
            hba.write("host all all 10.213.0.0/16 trust\n")
        env.start(
            [
                *as_postgres, str(PG_BIN / "postgres"), "-D", str(data),
                "-c", "listen_addresses=*", "-p", "5432", "-c", f"unix_socket_directories={data}",
                "-c", "fsync=off", "-c", "max_connections=50",
            ],
            name="postgres",
            ready="database system is ready to accept connections",
            role=netns.SERVICES,
        )  # fmt: skip
        yield env
    finally:
        for process in reversed(env.processes):
            process.stop(signal.SIGINT if process.name == "postgres" else signal.SIGTERM)
        net.close()
        shutil.rmtree(tmp, ignore_errors=True)
        left = {name for name in netns.namespaces() - before if name.startswith(net.tag)}
        assert not left, f"namespaces left behind: {left}"


class Client:
    """``tests.chaos.tasks_hosts.serve`` in the root namespace: the test's hands in
    the services' database."""

    def __init__(self, env: Services) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", CLIENT],
            cwd=ROOT,
            env=env.env(netns.ROOT),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def call(self, *words: object) -> Any:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(" ".join(map(str, words)) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the client exited ({self.process.poll()}) on {words}")
        return json.loads(line)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()  # end of commands: it exits
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        if self.process.stdout is not None:
            self.process.stdout.close()


def rounds(
    env: Services, client: Client, *, lease: str, run: str, first_guard: int
) -> dict[str, Any]:
    workers = [
        env.start(
            [
                sys.executable, "-m", "celery", "-A", "tests.celery_app", "worker",
                "-Q", env.queue, "-c", "1", "-P", "prefork", "-n", f"host{host}{lease}@%h",
                "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
            ],
            name=f"worker-{host}-lease{lease}",
            ready=" ready.",
            role=host,
            env=env.env(host, {HOST_ENV: host, "EXPLICIT_EXECUTION_LEASE": lease}),
        )
        for host in HOSTS
    ]  # fmt: skip
    markers = env.redis()
    cuts: list[dict[str, Any]] = []
    try:
        for job in range(ROUNDS):
            client.call("publish", run, job, first_guard + job)
            started, applied = f"hosts:started:{run}:{job}", f"hosts:applied:{run}:{job}"
            first = wait_for(
                functools.partial(markers.lindex, started, 0),
                timeout=60,
                what="the job to start on a host",
            ).decode()
            host, stale_pid = first.split(":")
            env.net.cut(host)
            cut_at = time.monotonic()
            finished: str | None = None
            try:
                with contextlib.suppress(TimeoutError):
                    finished = wait_for(
                        functools.partial(markers.lindex, applied, 0),
                        timeout=90,
                        interval=0.2,
                        what="the job to finish on another host",
                    ).decode()
                finished_after = time.monotonic() - cut_at
                # The link stays down past the lease, however fast the takeover was.
                time.sleep(max(0.0, CUT - (time.monotonic() - cut_at)))
            finally:
                env.net.restore(host)
            cut_for = time.monotonic() - cut_at
            markers.set(f"hosts:proceed:{run}:{job}", 1, ex=600)

            def stale_attempt(job: int = job, pid: int = int(stale_pid)) -> Any:
                rows = client.call("check", run)["attempts"]
                return next((r for r in rows if r[0] == job and r[1] == pid), None)

            stale = wait_for(stale_attempt, timeout=90, interval=0.5, what="the stale attempt")
            pg = markers.lindex(f"hosts:pg:{run}:{job}", 0)
            cuts.append(
                {
                    "host": host,
                    "finished on": finished,
                    "finished after cut (s)": round(finished_after, 1),
                    "cut (s)": round(cut_for, 1),
                    "stale outcome": stale[2],
                    "stale pg connection": pg.decode() if isinstance(pg, bytes) else "?",
                }
            )
        # Late redeliveries land before the history is read.
        time.sleep(2.0)
        history = client.call("check", run)
    finally:
        for worker in workers:
            worker.stop()
            env.processes.remove(worker)
    return {"cuts": cuts, "history": history, "logs": [w.log()[-3000:] for w in workers]}


def test_host_cut_off_past_its_lease() -> None:
    if os.geteuid() != 0:
        pytest.fail("host partitions need root for ip netns (CI runs as root)")
    started = time.monotonic()
    run = uuid.uuid4().hex[:10]
    with services() as env:
        client = Client(env)
        try:
            assert client.call("setup") == "ok"
            result = rounds(env, client, lease="1", run=run, first_guard=0)
            control = rounds(env, client, lease="0", run=run + "c", first_guard=100_000)
        finally:
            client.close()
    cuts, counts = result["cuts"], result["history"]["counts"]
    elsewhere = [
        c for c in cuts if c["finished on"] and not c["finished on"].startswith(c["host"] + ":")
    ]
    fenced = sum(1 for c in cuts if c["stale outcome"] == "fenced")
    control_counts = control["history"]["counts"]
    row = Row(
        scenario="host partitions",
        fault="the link of the host running a job cut past its lease (veth down), restored",
        faults=len(cuts),
        jobs=counts["jobs"],
        lost=counts["lost"],
        duplicates=counts["duplicates"],
        figures={
            "finished on another host while cut off": len(elsewhere),
            "stale commits fenced": fenced,
            "fence rows (takeovers)": result["history"]["fences"],
            "max finished after cut (s)": max(c["finished after cut (s)"] for c in cuts),
            "min cut (s)": min(c["cut (s)"] for c in cuts),
            # "survived": the stale host's PostgreSQL connection (opened before the cut)
            # lived through it, and its commit was refused on it; "reset": it did not.
            "stale host's pg connection across the cut": dict(
                Tally(c["stale pg connection"] for c in cuts)
            ),
        },
        holds=counts["lost"] == 0
        and counts["duplicates"] == 0
        and counts["done"] == ROUNDS
        and len(elsewhere) == ROUNDS
        and fenced == ROUNDS,
        control=(
            f"execution lease off: {control_counts['duplicates']} duplicate effects "
            f"(stale outcomes {sorted({c['stale outcome'] for c in control['cuts']})})"
        ),
        control_failed=control_counts["duplicates"] > 0,
        seconds=round(time.monotonic() - started, 1),
    )
    row.save()
    assert row.ok, (row, cuts, control["cuts"], result["logs"])
