"""Processes a test starts and must stop: one way to start them, see them ready, stop them.

Each runs in a session (process group) of its own with its output in a log file, so a
test can read what it did, a failure shows its log, and stopping it stops whatever it
started: a worker's pool children or a server's forks never outlive the test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parents[2]
"""The repository: the working directory and import path of the processes."""

Ready = str | Callable[[], bool]
"""When a process is ready: a line its log shows, or a check that answers True."""


def run(command: Sequence[str | Path], *, timeout: float, **kwargs: object) -> str:
    """Run ``command`` to its end; its output, or a failure that shows it."""
    done = subprocess.run(
        [str(part) for part in command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        **kwargs,  # type: ignore[call-overload]
    )
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout[-4000:]}"
    return str(done.stdout)


def project_env(
    *, db_name: str, queue: str, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of a process of the test project (``tests.settings``) on this
    test's database and queue; ``extra`` is added last."""
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "EXPLICIT_TEST_DB_NAME": db_name,
        "EXPLICIT_TEST_QUEUE": queue,
        "PYTHONPATH": str(ROOT),
        **(extra or {}),
    }


class ManagedProcess:
    """One subprocess in a process group of its own, logging to ``log_dir/name.log``.

    ``ready`` says when it is ready: a marker its log shows (a subclass may set
    ``ready_marker`` instead) or a check; with neither, it is ready once started.
    """

    kind = "process"
    """What it is, in error messages: ``worker w1a2b3c exited early``."""
    ready_marker: str | None = None
    ready_interval = 0.1

    def __init__(
        self,
        command: Sequence[str],
        *,
        name: str,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path = ROOT,
        ready: Ready | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._ready: Ready | None = ready if ready is not None else self.ready_marker
        #: ``begin_stop()`` sent its signal; ``stop()`` then only waits.
        self._stop_sent = False
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        try:
            self.process: subprocess.Popen[bytes] = subprocess.Popen(
                list(command),
                cwd=cwd,
                env=None if env is None else dict(env),
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except BaseException:
            self._log.close()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        """Everything it wrote so far (stdout and stderr)."""
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def is_ready(self) -> bool:
        if self._ready is None:
            return True
        if isinstance(self._ready, str):
            return self._ready in self.log()
        return self._ready()

    def wait_ready(self, timeout: float = 30.0) -> Self:
        """Return once it is ready; if it exits first or is not ready in ``timeout``,
        raise with its whole log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.is_ready():
                return self
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.kind} {self.name} exited early (code {self.process.returncode}):"
                    f"\n{self.log()}"
                )
            time.sleep(self.ready_interval)
        raise TimeoutError(f"{self.kind} {self.name} not ready in {timeout}s:\n{self.log()}")

    def child_pids(self) -> list[int]:
        """The processes it started itself (a worker's pool), by ``pgrep -P``."""
        out = subprocess.run(
            ["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True, check=False
        ).stdout
        return [int(pid) for pid in out.split()]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        """Send ``sig`` (unless ``begin_stop()`` sent one) and wait for it to exit; returns
        its exit code, or None if it had to be killed (SIGKILL to its process group after
        ``timeout``).

        Whatever is left of its process group is killed either way (children of a killed
        main process must not outlive the test). Stopping a stopped process returns its
        exit code again.
        """
        code: int | None = None
        if self.process.poll() is None:
            if not self._stop_sent:
                self.process.send_signal(sig)
            try:
                code = self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill_group()
                self.process.wait(5)
        else:
            code = self.process.returncode
        self.kill_group()
        self._log.close()
        return code

    def begin_stop(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` and return at once; ``stop()`` then waits for it. Several
        processes stopped this way shut down side by side (a prefork worker's warm
        shutdown takes about 1.7 s, most of it billiard joining the pool)."""
        if self.process.poll() is None and not self._stop_sent:
            self.process.send_signal(sig)
            self._stop_sent = True

    def kill_group(self) -> None:
        """SIGKILL to every process left in its process group."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
