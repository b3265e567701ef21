"""What one execution of a job knows about itself, kept on ``task.request.explicit``.

Every step of the job path reads it and the pipeline writes it; it is the one place
where "which attempt, which key, which fence" lives while the handler runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from celery_explicit import sensitive
from celery_explicit.errors import ExplicitError
from celery_explicit.headers import REDELIVERED_HEADER
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
    #: The key the message was published with, when it differs from ``key``.
    published_key: str = ""
    #: The effect's other names, checked and recorded with it (``key_history``).
    other_keys: tuple[str, ...] = ()
    #: Stored fingerprints that are the same call (the pre-``identity`` form).
    accepted_fingerprints: tuple[str, ...] = ()
    #: An effect block committed this attempt's row (a later record updates it).
    effect_row_written: bool = False
    recorded: bool = False
    #: The row was written with the effect's commit; its metric and log line wait
    #: for the handler's end (``pipeline``).
    line_pending: bool = False
    #: False for a direct function call: no message, so no attempt row.
    audited: bool = True
    #: The execution lease's fencing token (None: no lease, e.g. a direct call).
    fence: int | None = None
    #: Its effect was refused: a newer execution of this job took the lease over.
    lost_lease: bool = False
    #: Deliveries of this message so far, this one included (``delivery_limit``).
    deliveries: int = 1
    #: ``self.cancelled``'s look at the cancellation marks (``cancellation.Watch``),
    #: made at its first read: a layer above this one, hence untyped here.
    cancel_watch: Any = None
    #: The rate limit's rendered key (``celery_explicit.rate_limit``; "" if none).
    rate_key: str = ""
    #: Headers a deferral's re-publish of this job carries, set by a step whose
    #: admission stays good when a later step defers the job (a rate limit's reserved
    #: start): ``republish.defer`` adds them.
    deferral_headers: dict[str, Any] = field(default_factory=dict)
    #: Milliseconds spent per part of the attempt, for its log line: ``queue_wait``
    #: (sent to started), each step that ran (``execution_lease`` is the lease
    #: acquire), ``handler``, ``commit`` (the effect's ledger writes and COMMIT).
    timings: dict[str, float] = field(default_factory=dict)
    #: The task's sensitive fields and their values' text (``celery_explicit.sensitive``):
    #: scrubbed from every error message we store or log.
    sensitive: tuple[str, ...] = ()
    secrets: list[str] = field(default_factory=list)

    def scrub(self, text: str) -> str:
        return sensitive.scrub(text, self.secrets) if self.secrets else text

    def log_fields(self) -> dict[str, Any]:
        """The fields every log line about this execution carries."""
        return {
            "task": self.task_name,
            "job_id": self.task_id,
            "idempotency_key": self.key,
            "attempt": self.attempt,
            "correlation_id": self.correlation_id,
            "external_request_id": self.external_request_id,
            "deliveries": self.deliveries,
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


def redelivered(request: Any) -> bool:
    """Did the broker redeliver this job's message, here or before a deferral (whose
    re-publish carries the flag as a header: the copy that runs is still that
    redelivery)?"""
    return bool(delivery(request, "redelivered")) or bool(
        getattr(request, REDELIVERED_HEADER, False)
    )
