"""Real ``celery worker`` processes for tests whose behaviour depends on a worker."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class Worker:
    """One ``celery worker`` (prefork) on a queue of its own, logging to a file."""

    def __init__(self, *, queue: str, db_name: str, log_dir: Path, concurrency: int = 2,
                 name: str | None = None, extra_env: dict[str, str] | None = None) -> None:
        self.queue = queue
        self.name = name or f"w{uuid.uuid4().hex[:6]}"
        self.log_path = log_dir / f"{self.name}.log"
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings",
               "EXPLICIT_TEST_DB_NAME": db_name, "EXPLICIT_TEST_QUEUE": queue,
               "PYTHONPATH": str(ROOT), **(extra_env or {})}
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.celery_app", "worker",
             "-Q", queue, "-c", str(concurrency), "-P", "prefork", "-n", f"{self.name}@%h",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"],
            cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> Worker:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if " ready." in self.log():
                return self
            if self.process.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited early:\n{self.log()}")
            time.sleep(0.1)
        raise TimeoutError(f"worker {self.name} not ready in {timeout}s:\n{self.log()}")

    def child_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True,
                             text=True, check=False).stdout
        return [int(pid) for pid in out.split()]

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        # Children of a killed main process must not outlive the test.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self._log.close()


def wait_for(predicate: Callable[[], Any], *, timeout: float = 30.0,
             interval: float = 0.1, what: str = "condition",
             on_timeout: Callable[[], Any] | None = None) -> Any:
    """Poll ``predicate`` until it returns something truthy; its value is returned."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            context = f"; context: {on_timeout()!r}" if on_timeout else ""
            raise TimeoutError(f"timed out after {timeout}s waiting for {what} "
                               f"(last value {value!r}){context}")
        time.sleep(interval)
