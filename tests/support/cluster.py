"""A private three-node Redis Cluster on loopback (no replicas), for the state store on
a cluster: ``redis-server --cluster-enabled yes`` on three ports, then
``redis-cli --cluster create`` spreads the 16,384 slots over them."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from tests.support.ports import free_port
from tests.support.servers import PrivateRedis


def cluster_port() -> int:
    """A free port whose cluster bus port (10,000 higher, at most 65,535) is free too."""
    while True:
        port = free_port()
        if port <= 55535 and _free(port + 10000):
            return port


def _free(port: int) -> bool:
    with contextlib.closing(socket.socket()) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class PrivateCluster:
    def __init__(self, data_dir: Path, nodes: int = 3) -> None:
        self.nodes: list[PrivateRedis] = []
        for i in range(nodes):
            node_dir = data_dir / f"node-{i}"
            node = PrivateRedis(
                node_dir,
                durable=False,
                port=cluster_port(),
                extra=[
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", str(node_dir / "nodes.conf"),
                    "--cluster-node-timeout", "2000",
                ],
            )  # fmt: skip
            node.start()
            self.nodes.append(node)
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (it comes with redis-server)")
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        done = subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
        self._wait_ok()

    @property
    def url(self) -> str:
        """The state store's URL: every node as a start-up node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def _wait_ok(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [redis.Redis(port=n.port).cluster("info") for n in self.nodes]
            if all(s.get("cluster_state") == "ok" for s in states):
                return
            time.sleep(0.1)
        raise TimeoutError("the cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None:
                node.stop()
