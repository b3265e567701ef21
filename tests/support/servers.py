"""Servers of a test's own, to stop, kill and restart without touching the session's."""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import redis

from tests.support.ports import free_port
from tests.support.processes import ManagedProcess


class RedisServerProcess(ManagedProcess):
    """One run of a ``redis-server``; ready when it answers PING through ``client()``."""

    kind = "redis-server"
    ready_interval = 0.05

    def __init__(
        self,
        command: Sequence[str],
        *,
        name: str,
        log_dir: Path,
        client: Callable[[], redis.Redis],
    ) -> None:
        super().__init__(command, name=name, log_dir=log_dir)
        self._client = client

    def is_ready(self) -> bool:
        if not self.alive():  # a port taken by another server must not pass for ours
            return False
        client = self._client()
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False
        finally:
            client.close()


class PrivateRedis:
    """A ``redis-server`` of the test's own, to stop and start without touching the
    session's Redis. Append-only with fsync on every write: what it acknowledged
    survives a kill, so a lost message is the relay's fault, not the broker's.

    ``unix_socket=True`` listens on ``data_dir/redis.sock`` only (no TCP port);
    ``durable=False`` writes nothing to disk. Each start logs to
    ``data_dir/redis-server-N.log``, shown if it does not come up.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        unix_socket: bool = False,
        durable: bool = True,
        extra: Sequence[str] = (),
        sentinel_conf: Path | None = None,
        port: int | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.extra = list(extra)  # more redis-server options, e.g. --replicaof
        # A Sentinel instead of a server: its config file (Sentinel rewrites it).
        self.sentinel_conf = sentinel_conf
        self.durable = durable
        self.socket_path: Path | None = data_dir / "redis.sock" if unix_socket else None
        self.port = 0 if unix_socket else (port or free_port())
        self.url = (
            f"unix://{self.socket_path}" if self.socket_path else f"redis://127.0.0.1:{self.port}/0"
        )
        self.server: RedisServerProcess | None = None
        self._starts = 0

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The running ``redis-server``; None while it is stopped."""
        return self.server.process if self.server is not None else None

    def start(self, timeout: float = 10.0) -> PrivateRedis:
        """Start it (again: same port or socket, same data directory); returns once it
        answers PING."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/lib.sh installs it)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        listen = (
            ["--port", "0", "--unixsocket", str(self.socket_path)]
            if self.socket_path
            else ["--port", str(self.port), "--bind", "127.0.0.1"]
        )
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "always"]
            if self.durable
            else ["--appendonly", "no"]
        )
        command = [
            binary,
            *listen,
            "--save",
            "",
            *persistence,
            "--dir",
            str(self.data_dir),
            *self.extra,
        ]
        if self.sentinel_conf is not None:
            command = [binary, str(self.sentinel_conf), "--sentinel", *listen, *self.extra]
        self._starts += 1
        server = RedisServerProcess(
            [*command, "--daemonize", "no"],
            name=f"redis-server-{self._starts}",
            log_dir=self.data_dir,
            client=self.client,
        )
        try:
            server.wait_ready(timeout)
        except BaseException:
            server.stop(signal.SIGKILL, timeout=10)
            raise
        self.server = server
        return self

    def kill(self) -> None:
        """SIGKILL: what it acknowledged is on disk (``durable``), nothing else is."""
        self._stop(signal.SIGKILL)

    def stop(self) -> None:
        """A clean shutdown (SIGTERM)."""
        self._stop(signal.SIGTERM)

    def ping(self) -> bool:
        """Whether it answers PING now."""
        client = self.client()
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def client(self) -> redis.Redis:
        if self.socket_path:
            return redis.Redis(unix_socket_path=str(self.socket_path))
        return redis.Redis(port=self.port)

    def _stop(self, sig: int) -> None:
        if self.server is not None:
            self.server.stop(sig, timeout=10)
        self.server = None
