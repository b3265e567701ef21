"""Real ``celery worker`` processes for tests whose behaviour depends on a worker."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from tests.support.processes import ROOT, ManagedProcess, project_env


class Worker(ManagedProcess):
    """One ``celery worker`` (prefork) on a queue of its own, logging to a file.

    Ready when its log says `` ready.``; ``stop()`` is a warm shutdown (SIGTERM), then
    SIGKILL to its pool if it does not exit in time.
    """

    kind = "worker"
    ready_marker = " ready."

    def __init__(
        self,
        *,
        queue: str,
        db_name: str,
        log_dir: Path,
        concurrency: int = 2,
        name: str | None = None,
        extra_env: dict[str, str] | None = None,
        prefetch_multiplier: int | None = None,
    ) -> None:
        self.queue = queue
        name = name or f"w{uuid.uuid4().hex[:6]}"
        # fmt: off
        command = [
            sys.executable, "-m", "celery", "-A", "tests.celery_app", "worker",
            "-Q", queue, "-c", str(concurrency), "-P", "prefork", "-n", f"{name}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
        ]
        # fmt: on
        if prefetch_multiplier is not None:
            # More messages than processes: the extra ones wait in the main process for
            # a free process (the pool's semaphore), as they do under Celery's default 4.
            command += ["--prefetch-multiplier", str(prefetch_multiplier)]
        super().__init__(
            command,
            name=name,
            log_dir=log_dir,
            env=project_env(db_name=db_name, queue=queue, extra=extra_env),
        )


def start_checked(
    *,
    db_name: str,
    program: Sequence[str] = ("-m", "celery"),
    extra_env: dict[str, str] | None = None,
    stderr_apart: bool = False,
) -> subprocess.Popen[str]:
    """A ``celery worker`` (prefork ``-c 1``) on a queue of its own, for a test of
    whether it refuses to start: its output piped to the test (stderr into stdout, or
    apart with ``stderr_apart``), no log file, no process group.

    ``program`` is what ``python`` runs before Celery's own arguments (``-A
    tests.celery_app worker ...``): ``-m celery``, or ``-c <wrapper> ...`` that runs
    Celery's command line after changing something first. Read it with ``refusal()``
    or ``lines_until_ready()``."""
    queue = f"q-{uuid.uuid4().hex[:10]}"
    env = project_env(db_name=db_name, queue=queue, extra=extra_env)
    # fmt: off
    command = [
        sys.executable, *program, "-A", "tests.celery_app", "worker", "-Q", queue,
        "-c", "1", "-P", "prefork", "--without-gossip", "--without-mingle",
        "--without-heartbeat", "-l", "INFO",
    ]
    # fmt: on
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if stderr_apart else subprocess.STDOUT,
        text=True,
    )


def refusal(worker: subprocess.Popen[str]) -> tuple[str, str]:
    """Wait (90 s at most) for a worker of ``start_checked()`` that should refuse to
    start to exit; killed in any case. Its stdout and stderr ("" unless apart); its
    exit code is ``worker.returncode``."""
    try:
        out, err = worker.communicate(timeout=90)
    finally:
        worker.kill()
    return out, err or ""


def lines_until_ready(worker: subprocess.Popen[str]) -> list[str]:
    """Read a worker of ``start_checked()`` that should start until it says
    `` ready.`` (Celery logs to stderr), then stop it: the lines read."""
    stream = worker.stderr if worker.stderr is not None else worker.stdout
    lines: list[str] = []
    try:
        assert stream is not None
        for line in stream:
            lines.append(line)
            if " ready." in line:
                break
    finally:
        worker.terminate()
        worker.communicate(timeout=30)
    return lines
