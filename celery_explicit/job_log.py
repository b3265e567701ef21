"""Log lines that name their job, in Celery's default format and as data.

Every line celery-explicit writes while a job runs starts with the job, in its text:

    [10:13:26,090: WARNING/ForkPoolWorker-2] shop.capture[5b9c…] key=payment:3:capture:
    attempt 1 ended: failed_permanent in 41 ms (CardDeclined: card declined)

and carries the same facts as record attributes (``job_id``, ``task``,
``idempotency_key``, ``correlation_id``, ``attempt``, ``deliveries``, ...) for a JSON
formatter (python-json-logger; the LOGGING snippet is in docs/reference.md). The
pipeline binds the job when a delivery starts and unbinds it when it ends; a line
written outside a job (the relay, a publish) carries what its caller passes.

A traceback is logged once: an error whose traceback one of our lines carried
(the attempt line of an error nobody classified) is marked, and ``OneTraceback``
leaves it out of Celery's own ``raised unexpected`` line for the same error.
"""

from __future__ import annotations

import logging
import sys
from contextvars import ContextVar, Token
from typing import Any

_job: ContextVar[dict[str, Any] | None] = ContextVar("explicit_job", default=None)


def bind(fields: dict[str, Any]) -> Token[dict[str, Any] | None]:
    """Make ``fields`` (``Execution.log_fields()``) the current job's."""
    return _job.set(fields)


def update(**fields: Any) -> None:
    """Add facts learnt while the job runs (its delivery count, a lock owner)."""
    job = _job.get()
    if job is not None:
        job.update(fields)


def in_job() -> bool:
    """Whether a job is running in this context: a caller can skip building fields
    that ``update`` would drop."""
    return _job.get() is not None


def reset(token: Token[dict[str, Any] | None]) -> None:
    _job.reset(token)


def current() -> dict[str, Any]:
    return dict(_job.get() or {})


class JobLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger whose lines start with ``task[job_id] key=...:`` and carry the job's
    fields; fields passed in ``extra`` win (a line about another job names that one)."""

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        if not self.isEnabledFor(level):
            return
        fields = {**(_job.get() or {}), **(kwargs.get("extra") or {})}
        kwargs["extra"] = fields
        prefix = _prefix(fields)
        if prefix:
            # A key may hold "%": escaped when the message is %-formatted with args.
            msg = (prefix.replace("%", "%%") if args else prefix) + str(msg)
        kwargs.setdefault("stacklevel", 3)
        _mark_traceback(kwargs.get("exc_info"))
        self.logger.log(level, msg, *args, **kwargs)


#: Set on an error whose traceback one of our lines logged.
_TRACEBACK_LOGGED = "_explicit_traceback_logged"


def _mark_traceback(exc_info: Any) -> None:
    # exc_info as logging takes it: an exception, a sys.exc_info() tuple, or True.
    if exc_info is True:
        exc_info = sys.exc_info()
    error = exc_info[1] if isinstance(exc_info, tuple) else exc_info
    if isinstance(error, BaseException):
        setattr(error, _TRACEBACK_LOGGED, True)


class OneTraceback(logging.Filter):
    """Keeps a record but drops its traceback when one of our lines logged that
    error's traceback already.

    Added to Celery's ``celery.app.trace`` logger (``bootsteps.install``): for an
    error nobody classified Celery logs ``Task ...[id] raised unexpected: ...`` with the
    traceback (celery/app/trace.py, TraceInfo._log_error), after our attempt line
    logged it with the job's fields; the worker's log showed it twice.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if getattr(error, _TRACEBACK_LOGGED, False):
            record.exc_info = None
            record.exc_text = None
        return True


#: The one filter, so adding it again is a no-op (``Filterer.addFilter``).
one_traceback = OneTraceback()


def _prefix(fields: dict[str, Any]) -> str:
    task, job_id = fields.get("task"), fields.get("job_id")
    if not task and not job_id:
        return ""
    key = fields.get("idempotency_key")
    return f"{task or '?'}[{job_id or '?'}]" + (f" key={key}" if key else "") + ": "


def get_logger(name: str) -> JobLogger:
    return JobLogger(logging.getLogger(name), {})
