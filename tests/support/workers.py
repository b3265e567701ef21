"""Real ``celery worker`` processes for tests whose behaviour depends on a worker."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

from tests.support.processes import ManagedProcess, project_env


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
        super().__init__(
            command,
            name=name,
            log_dir=log_dir,
            env=project_env(db_name=db_name, queue=queue, extra=extra_env),
        )
