"""What one execution of a job knows about itself, kept on ``task.request.explicit``.

Every step of the job path reads it and the pipeline writes it; it is the one place
where "which attempt, which key, which fence" lives while the handler runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from celery_explicit.errors import ExplicitError
from celery_explicit.outcomes import Outcome


@dataclass
class Execution:
    task_id: str
    task_name: str
    key: str
    fingerprint: str
    attempt: int
    started_at: datetime
    correlation_id: str
    outcome: Outcome | None = None
    external_request_id: str = ""
    dedup_id: str = ""
    #: An effect block committed this attempt's row (a later record updates it).
    effect_row_written: bool = False
    recorded: bool = False
    #: False for a direct function call: no message, so no attempt row.
    audited: bool = True
    #: The execution lease's fencing token (None: no lease, e.g. a direct call).
    fence: int | None = None
    #: Its effect was refused: a newer execution of this job took the lease over.
    lost_lease: bool = False

    def log_fields(self) -> dict[str, Any]:
        """The fields every log line about this execution carries."""
        return {
            "task": self.task_name,
            "job_id": self.task_id,
            "idempotency_key": self.key,
            "attempt": self.attempt,
            "correlation_id": self.correlation_id,
            "external_request_id": self.external_request_id,
        }


def current(request: Any, task_name: str) -> Execution:
    """The running execution of ``request``, or an error naming the task."""
    execution = getattr(request, "explicit", None)
    if not isinstance(execution, Execution):
        raise ExplicitError(
            f"Task {task_name}: effect() and set_external_request_id() "
            "work only while the task runs"
        )
    return execution


def running(request: Any) -> Execution | None:
    execution = getattr(request, "explicit", None)
    return execution if isinstance(execution, Execution) else None


def delivery(request: Any, name: str) -> Any:
    """A field of the broker's delivery info (routing key, redelivered flag)."""
    return (request.delivery_info or {}).get(name)
