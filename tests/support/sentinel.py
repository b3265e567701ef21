"""A private Redis primary, its replica and three Sentinels on loopback: a failover as
Sentinel performs it, for the state store configured the way users configure it.

The primary and replica are ``replication.PrimaryReplica``'s (``sever()`` loses what the
primary writes on the way); ``kill_primary()`` and ``wait_for_failover()`` let Sentinel
notice (``down-after-milliseconds``), agree (quorum 2 of 3) and promote the replica,
instead of the pair's own ``fail_over()``.
"""

from __future__ import annotations

import time
from pathlib import Path

import redis

from tests.support.ports import free_port
from tests.support.replication import PrimaryReplica
from tests.support.servers import PrivateRedis

MASTER = "explicit-test"
DOWN_AFTER_MS = 500


class SentinelGroup(PrimaryReplica):
    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
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
        for sentinel in self.sentinels:
            if sentinel.process is not None:
                sentinel.stop()
        super().stop()
