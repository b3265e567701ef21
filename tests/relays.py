"""Real ``manage.py outbox_relay`` processes, and what the tests read from the broker.

Run as a module (``python -m tests.relays no-skip-locked``) it starts one of the
negative-control relays: the production relay with one safeguard of its claim taken
out, to show that the tests of that safeguard can fail (or, ``slow-mark``, the
production relay with a pause where a kill must be survived).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.workers import ROOT


class RelayProcess:
    """One relay process, logging to a file; ``control`` picks a negative control."""

    def __init__(self, *, db_name: str, log_dir: Path, queue: str, args: tuple[str, ...] = (),
                 broker_url: str | None = None, control: str | None = None,
                 name: str | None = None) -> None:
        self.name = name or f"relay-{uuid.uuid4().hex[:6]}"
        self.log_path = log_dir / f"{self.name}.log"
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings",
               "EXPLICIT_TEST_DB_NAME": db_name, "EXPLICIT_TEST_QUEUE": queue,
               "PYTHONPATH": str(ROOT)}
        if broker_url:
            env["EXPLICIT_TEST_BROKER_URL"] = broker_url
        command = ([sys.executable, "-m", "tests.relays", control] if control
                   else [sys.executable, "-m", "django", "outbox_relay"])
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen([*command, *args], cwd=ROOT, env=env, stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> RelayProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "outbox relay ready" in self.log():
                return self
            if self.process.poll() is not None:
                raise RuntimeError(f"relay {self.name} exited early:\n{self.log()}")
            time.sleep(0.05)
        raise TimeoutError(f"relay {self.name} not ready in {timeout}s:\n{self.log()}")

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        """Signal it and wait; returns its exit code (None if it had to be killed)."""
        code: int | None = None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                code = self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        else:
            code = self.process.returncode
        if not self._log.closed:
            self._log.close()
        return code


def relay_starter(queue: str, tmp_path: Path) -> Iterator[Any]:
    """Body of a test module's ``start_relay`` fixture (it depends on ``transactional_db``,
    so the relays see committed rows and stop before the tables are flushed): start
    relay processes publishing to this test's queue; all are stopped afterwards."""
    from django.db import connection

    started: list[RelayProcess] = []

    def start(*args: str, broker_url: str | None = None, control: str | None = None,
              ready: bool = True) -> RelayProcess:
        relay = RelayProcess(db_name=connection.settings_dict["NAME"], log_dir=tmp_path,
                             queue=queue, args=args, broker_url=broker_url, control=control)
        started.append(relay)
        return relay.wait_ready() if ready else relay

    yield start
    for relay in started:
        relay.stop()


def queued(client: Any, queue: str) -> list[dict[str, Any]]:
    """Messages waiting in a Redis-broker queue, oldest first, as
    ``{"id", "task", "headers", "args", "kwargs"}``."""
    messages = []
    # kombu LPUSHes and workers BRPOP: the oldest message is at the right end.
    for raw in reversed(client.lrange(queue, 0, -1)):
        envelope = json.loads(raw)
        args, kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
        headers = envelope["headers"]
        messages.append({"id": headers["id"], "task": headers["task"], "headers": headers,
                         "args": args, "kwargs": kwargs})
    return messages


def free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateRedis:
    """A ``redis-server`` of the test's own, to stop and start without touching the
    session's Redis. Append-only with fsync on every write: what it acknowledged
    survives a kill, so a lost message is the relay's fault, not the broker's."""

    def __init__(self, data_dir: Path) -> None:
        self.port = free_port()
        self.data_dir = data_dir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> PrivateRedis:
        import redis

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.data_dir),
             "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None

    def client(self) -> Any:
        import redis

        return redis.Redis(port=self.port)


# --- negative controls, run as ``python -m tests.relays NAME [outbox_relay options]`` --------


def main() -> None:
    import django

    django.setup()
    from django_outbox.relay import Relay

    class NoSkipLockedRelay(Relay):
        """A plain SELECT: two relays read the same rows and both publish them."""

        lock_clause = ""

    class OrderBlindRelay(Relay):
        """SKIP LOCKED without the head-of-key test: relays publish one key in parallel."""

        head_of_key_clause = ""

    class SlowMarkRelay(Relay):
        """The production relay, pausing between the send and the mark (``flushed`` in
        its log): a kill there lands in that window every time, not by luck."""

        def _mark(self, events: list[Any], status: Any) -> None:
            if events and status == "published":
                print(f"flushed {len(events)}", flush=True)
                time.sleep(5)
            super()._mark(events, status)

    class MarksUnsentRelay(Relay):
        """Marks events published without sending them: the loss the kill tests look for."""

        def _publish(self, event: Any, producer: Any) -> Any:
            from django_outbox.models import OutboxStatus

            return OutboxStatus.PUBLISHED

    controls = {"no-skip-locked": NoSkipLockedRelay, "order-blind": OrderBlindRelay,
                "slow-mark": SlowMarkRelay, "marks-unsent": MarksUnsentRelay}
    parser = argparse.ArgumentParser()
    parser.add_argument("control", choices=sorted(controls))
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--poll-interval", type=float, default=None)
    options = parser.parse_args()
    relay = controls[options.control](batch_size=options.batch_size,
                                      poll_interval=options.poll_interval)
    signal.signal(signal.SIGTERM, lambda *_: relay.stop())
    relay.run(on_ready=lambda wakeup: print("outbox relay ready (negative control "
                                            f"{options.control})", flush=True))


if __name__ == "__main__":
    main()
