"""A RabbitMQ node of a test's own, to SIGKILL and start again on its data directory
without touching the machine's own broker."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import amqp

from tests.support.ports import free_port
from tests.support.processes import ManagedProcess

# Debian's /usr/sbin/rabbitmq-server, started by root, runs the node as the rabbitmq
# user (`su rabbitmq`), who cannot write in the test's tmp directory; the script it
# calls runs the node as whoever starts it.
_SCRIPTS = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")


class RabbitNodeProcess(ManagedProcess):
    """One run of ``rabbitmq-server``; ready when it answers an AMQP handshake."""

    kind = "rabbitmq-server"
    ready_interval = 0.2

    def __init__(
        self,
        command: Sequence[str],
        *,
        name: str,
        log_dir: Path,
        env: Mapping[str, str],
        answers: Callable[[], bool],
    ) -> None:
        super().__init__(command, name=name, log_dir=log_dir, env=env)
        self._answers = answers

    def is_ready(self) -> bool:
        # A port taken by another server must not pass for ours.
        return self.alive() and self._answers()


class PrivateRabbitMQ:
    """A single RabbitMQ node of the test's own, on a free port, its database, logs and
    Erlang cookie under ``data_dir``, no plugins. ``kill()`` SIGKILLs the Erlang VM;
    ``start()`` again starts the same node (name, ports) on the same database, so a
    quorum queue comes back with what it had confirmed (``durable``: a message is
    confirmed once it is in the queue's log on disk).

    The same small interface as ``servers.PrivateRedis``: ``start()``, ``kill()``,
    ``stop()``, ``ping()``, ``url``, ``durable``. Each start logs to
    ``data_dir/rabbitmq-server-N.log``, shown if it does not come up; the node's own log
    is under ``data_dir/log``. To look at a running node:
    ``HOME=<data_dir> rabbitmqctl -n <node> list_queues name type messages``.
    """

    #: What it confirmed survives a kill (quorum queues; a classic queue keeps only
    #: persistent messages, and only those it had written).
    durable = True

    def __init__(self, data_dir: Path, *, port: int | None = None) -> None:
        self.data_dir = data_dir
        self.port = port or free_port()
        # The Erlang distribution's port: RabbitMQ's default (port + 20000) may be taken.
        self.dist_port = free_port()
        self.node = f"explicit-{self.port}@localhost"
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}//"
        self.server: RabbitNodeProcess | None = None
        self._starts = 0

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The running ``rabbitmq-server`` script (the Erlang VM is its child); None
        while it is stopped."""
        return self.server.process if self.server is not None else None

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "rabbitmq.pid"

    def start(self, timeout: float = 60.0) -> PrivateRabbitMQ:
        """Start it (again: same node name, ports and database); returns once it answers
        an AMQP handshake."""
        script = str(_SCRIPTS) if _SCRIPTS.exists() else shutil.which("rabbitmq-server")
        if script is None:
            raise RuntimeError("rabbitmq-server is not installed (scripts/lib.sh installs it)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "rabbitmq.conf"
        config.write_text(f"listeners.tcp.default = 127.0.0.1:{self.port}\n")
        no_plugins = self.data_dir / "enabled_plugins"
        no_plugins.write_text("[].\n")
        # Read by rabbitmq-env in place of /etc/rabbitmq/rabbitmq-env.conf (the
        # machine's node name and settings).
        env_conf = self.data_dir / "rabbitmq-env.conf"
        env_conf.write_text("")
        self.pid_file.unlink(missing_ok=True)  # the VM writes its pid there as it boots
        env = {
            **os.environ,
            # The Erlang cookie is made there on the first start: nothing is written
            # outside data_dir, and the machine's cookie is left alone.
            "HOME": str(self.data_dir),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.data_dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.data_dir / "log"),
            "RABBITMQ_CONFIG_FILE": str(config),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(no_plugins),
            "RABBITMQ_CONF_ENV_FILE": str(env_conf),
            "RABBITMQ_PID_FILE": str(self.pid_file),
            "ERL_FLAGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }
        self._starts += 1
        server = RabbitNodeProcess(
            [script],
            name=f"rabbitmq-server-{self._starts}",
            log_dir=self.data_dir,
            env=env,
            answers=self.ping,
        )
        try:
            server.wait_ready(timeout)
        except BaseException:
            self.server = server
            self.kill()
            raise
        self.server = server
        return self

    def kill(self) -> None:
        """SIGKILL the Erlang VM: what a quorum queue confirmed is on disk, nothing
        else is."""
        if self.server is None:
            return
        pid = self._vm_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            # The script waits on the VM: it reaps it and exits.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.server.process.wait(10)
        # Whatever is left of its process group (the script, erl_child_setup; the VM
        # itself if it had not written its pid yet). epmd, shared with the machine's
        # node, is not in it: it runs as a daemon in a process session of its own.
        self._stop(signal.SIGKILL)

    def stop(self) -> None:
        """A clean shutdown (SIGTERM: the script stops the node)."""
        self._stop(signal.SIGTERM)

    def ping(self) -> bool:
        """Whether it answers an AMQP handshake now."""
        connection = amqp.Connection(
            f"127.0.0.1:{self.port}", userid="guest", password="guest", connect_timeout=1
        )
        try:
            connection.connect()
        except (OSError, amqp.exceptions.AMQPError):
            connection.collect()
            return False
        connection.close()
        return True

    def _vm_pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def _stop(self, sig: int) -> None:
        if self.server is not None:
            self.server.stop(sig, timeout=30)
        self.server = None
