"""A private Redis primary, its replica and three Sentinels on loopback: a failover as
Sentinel performs it, for the state store configured the way users configure it.

The replica replicates through a proxy, so ``sever()`` can lose what the primary writes
on the way (asynchronous replication's window, made wide); ``kill_primary()`` and
``wait_for_failover()`` let Sentinel notice (``down-after-milliseconds``), agree
(quorum 2 of 3) and promote the replica.
"""

from __future__ import annotations

import time
from pathlib import Path

import redis

from tests.support.ports import free_port
from tests.support.proxy import CuttableProxy
from tests.support.servers import PrivateRedis

MASTER = "explicit-test"
DOWN_AFTER_MS = 500


class SentinelGroup:
    def __init__(self, data_dir: Path) -> None:
        self.primary = PrivateRedis(
            data_dir / "primary", durable=False, extra=["--repl-diskless-sync-delay", "0"]
        )
        self.primary.start()
        self.link = CuttableProxy(("127.0.0.1", self.primary.port))
        self.replica = PrivateRedis(
            data_dir / "replica",
            durable=False,
            extra=[
                "--replicaof", "127.0.0.1", str(self.link.port),
                # What Sentinel reaches the replica at (not the proxy's side of it).
                "--replica-announce-ip", "127.0.0.1",
            ],
        )  # fmt: skip
        self.replica.start()
        self.sentinels: list[PrivateRedis] = []
        for i in range(3):
            port = free_port()
            conf = data_dir / f"sentinel-{i}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {self.primary.port} 2\n"
                f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER} 5000\n"
                f"sentinel parallel-syncs {MASTER} 1\n"
            )
            sentinel = PrivateRedis(
                data_dir / f"sentinel-{i}", durable=False, sentinel_conf=conf, port=port
            )
            sentinel.start()
            self.sentinels.append(sentinel)
        self.wait_in_sync()
        self._wait_sentinels_know_the_replica()

    @property
    def url(self) -> str:
        """The state store's URL, in Celery's sentinel form."""
        hosts = ";".join(f"sentinel://127.0.0.1:{s.port}" for s in self.sentinels)
        return f"{hosts}/0?master_name={MASTER}"

    def master_port(self) -> int:
        reply = redis.Redis(port=self.sentinels[0].port).execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER
        )
        return int(reply[1])

    def wait_in_sync(self, timeout: float = 10.0) -> None:
        primary = redis.Redis(port=self.primary.port)
        replica = redis.Redis(port=self.replica.port)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = replica.info("replication")
            offset = primary.info("replication")["master_repl_offset"]
            if info.get("master_link_status") == "up" and info["slave_repl_offset"] >= offset:
                return
            time.sleep(0.05)
        raise TimeoutError(f"the replica did not catch up within {timeout} s")

    def _wait_sentinels_know_the_replica(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            known = [
                redis.Redis(port=s.port).execute_command("SENTINEL", "REPLICAS", MASTER)
                for s in self.sentinels
            ]
            others = [
                redis.Redis(port=s.port).execute_command("SENTINEL", "SENTINELS", MASTER)
                for s in self.sentinels
            ]
            if all(known) and all(len(o) == 2 for o in others):
                return
            time.sleep(0.1)
        raise TimeoutError("the Sentinels did not find the replica and each other")

    def sever(self) -> None:
        """From now on nothing the primary sends reaches the replica."""
        self.link.dropping = True

    def kill_primary(self) -> None:
        self.primary.kill()

    def wait_for_failover(self, timeout: float = 30.0) -> float:
        """Seconds until the Sentinels name the replica as the primary."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            try:
                if self.master_port() == self.replica.port:
                    return time.monotonic() - start
            except redis.RedisError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"no failover within {timeout} s")

    def stop(self) -> None:
        self.link.close()
        for server in (*self.sentinels, self.replica, self.primary):
            if server.process is not None:
                server.stop()
