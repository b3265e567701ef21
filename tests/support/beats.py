"""Real ``celery beat`` processes for the periodic tests."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

from tests.support.processes import ManagedProcess, project_env


class Beat(ManagedProcess):
    """One ``celery beat`` with ``scheduler``, its own schedule file, logging to a file.
    Ready when its log says ``beat: Starting...``."""

    kind = "beat"
    ready_marker = "beat: Starting..."

    def __init__(
        self,
        *,
        scheduler: str,
        queue: str,
        db_name: str,
        log_dir: Path,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        name = f"beat{uuid.uuid4().hex[:6]}"
        # fmt: off
        command = [
            sys.executable, "-m", "celery", "-A", "tests.celery_app", "beat",
            "-S", scheduler, "-s", str(log_dir / f"{name}.schedule"),
            "--max-interval", "1", "-l", "INFO",
        ]
        # fmt: on
        super().__init__(
            command,
            name=name,
            log_dir=log_dir,
            env=project_env(db_name=db_name, queue=queue, extra=extra_env),
        )
