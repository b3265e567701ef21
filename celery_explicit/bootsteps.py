"""Our consumer bootsteps, added to each Celery app once.

- ``LeaseKeeper`` (``celery_explicit.message_lease_keeper``): extends each held message's
  visibility lease and each running handler's execution lease.
- ``RecordUndecodable`` (below): the Redis transport decodes a message's body in the
  worker's main process, before any task code runs; Celery's
  ``Consumer.on_decode_error`` then logs it and acks it, and the message is gone. The
  step wraps that method so the message becomes a dead letter (reason ``bad_input``,
  raw body kept) before the ack.
- ``ArchiveDeadChildMetrics`` (below): the worker's metrics files of a pool child
  that exited are folded into one archive (``celery_explicit.worker_metrics``), in the
  parent, so ``max_tasks_per_child`` does not grow the metrics directory.
- ``RefuseMisshapen`` (below): Celery's task handler reads the task name and the
  decoded body in the main process before any request exists (``'args' in
  message.payload``); a body that decodes to a number or to bytes raised TypeError
  there, which Celery treats as an unrecoverable error: the worker stopped, and the
  unacked message came back to stop the next one. The step makes such an error
  Celery's own ``InvalidTaskError``: the one message is rejected and dead-lettered
  (``django_outbox.store.unreached``). So is a message whose headers or body nest deeper
  than ``request.MAX_NESTING`` (see ``celery_explicit.request``), before Celery reads it.

Bootsteps are Celery's documented extension point for the consumer
(https://docs.celeryq.dev/en/stable/userguide/extending.html#consumer-bootsteps);
``app.steps["consumer"]`` is a set, read when the worker builds its consumer.
``ExplicitTask.on_bound`` calls ``install`` for the app a task is bound to; the
first call per app adds the steps, later ones do nothing.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any

from celery import bootsteps, signals
from celery.exceptions import InvalidTaskError

from celery_explicit import job_log, key_history, redis_state, store, versions, worker_metrics
from celery_explicit.conf import settings
from celery_explicit.errors import ContractError
from celery_explicit.message_lease_keeper import LeaseKeeper
from celery_explicit.message_lease_transport import on_worker_init
from celery_explicit.request import MAX_NESTING, nested_deeper_than

logger = job_log.get_logger("celery_explicit.bootsteps")
#: Our checks' ids start with this (the app's checks, registered by django_outbox).
CHECK_PREFIX = "django_outbox."

_installed: weakref.WeakSet[Any] = weakref.WeakSet()
#: Per Celery app, the refusal its task modules ended on (``import_tasks``).
_refused: weakref.WeakKeyDictionary[Any, ContractError] = weakref.WeakKeyDictionary()


class RecordUndecodable(bootsteps.StartStopStep):
    label = "celery_explicit: dead-letter undecodable messages"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        # Celery has no hook for an undecodable body; this wraps the bound method
        # the consumer calls (celery/worker/consumer/consumer.py, Consumer.
        # on_decode_error, called from create_task_handler: https://github.com/celery/
        # celery/blob/v5.5.0/celery/worker/consumer/consumer.py). tests/integration/
        # test_upstream_seams.py fails if upstream renames or stops calling it.
        original = parent.on_decode_error

        def on_decode_error(message: Any, exc: BaseException) -> None:
            headers = getattr(message, "headers", None) or {}
            store.get().record_undecodable(
                task_id=headers.get("id"),
                task_name=str(headers.get("task") or "?"),
                message=message,
                error=exc,
            )
            original(message, exc)

        parent.on_decode_error = on_decode_error


#: What a body of the wrong shape raises in a strategy (Python's own errors on data).
MISSHAPEN = (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError)


class RefuseMisshapen(bootsteps.StartStopStep):
    label = "celery_explicit: refuse a misshapen message instead of stopping the worker"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        # Celery reads a message's task name, id and body in the main process, in the
        # handler this method builds (celery/worker/consumer/consumer.py, Consumer.
        # create_task_handler, called by loop_args at each consumer start); it catches
        # only InvalidTaskError, ContentDisallowed and DecodeError. Python's own errors
        # on data of the wrong shape become InvalidTaskError for that one message.
        original = parent.create_task_handler

        def create_task_handler(*args: Any, **kwargs: Any) -> Any:
            handler = original(*args, **kwargs)

            def on_task_received(message: Any) -> Any:
                too_deep = _too_deep(message)
                if too_deep:
                    return parent.on_invalid_task(None, message, InvalidTaskError(too_deep))
                try:
                    return handler(message)
                except MISSHAPEN as exc:
                    refused = InvalidTaskError(
                        "message is not a task message Celery can read: "
                        f"{type(exc).__name__}: {exc}"
                    )
                    if getattr(message, "acknowledged", False):
                        # Already acked or rejected before it failed: only record it.
                        signals.task_rejected.send(sender=parent, message=message, exc=refused)
                        return None
                    return parent.on_invalid_task(None, message, refused)

            return on_task_received

        parent.create_task_handler = create_task_handler


def _too_deep(message: Any) -> str | None:
    """Why ``message`` is nested too deep to hand on (None when it is not).

    Its headers and its decoded body, which Celery's handler decodes anyway (``'args'
    in message.payload``; kombu caches the result). A body that does not decode is left
    to the handler, which reports that its own way.
    """
    headers = getattr(message, "headers", None)
    where = "headers" if nested_deeper_than(headers) else None
    if where is None:
        try:
            payload = message.payload
        except Exception:  # the handler meets the same error and reports it its way
            payload = None
        where = "body" if nested_deeper_than(payload) else None
    if where is None:
        return None
    name = headers.get("task") if isinstance(headers, dict) else None
    return (
        f"message {where} nested deeper than {MAX_NESTING} levels (lists and dicts); "
        f"task {name if isinstance(name, str) else '?'}"
    )


class ArchiveDeadChildMetrics(bootsteps.StartStopStep):
    label = "celery_explicit: fold a dead pool child's metrics files into the archive"

    def register_with_event_loop(self, parent: Any, hub: Any) -> None:
        # Celery sends no signal in the parent when a pool child exits
        # (worker_process_shutdown runs in the child, and not at all in one that was
        # killed). billiard's pool calls its ``on_process_down(proc)`` for each child
        # it has joined, before it forks the replacement (billiard/pool.py,
        # Pool._join_exited_workers); Celery's AsynPool sets that attribute each time
        # the worker registers with its event loop (celery/concurrency/asynpool.py,
        # _create_process_handlers), just before the consumer's steps register
        # (celery/worker/loops.py, asynloop): wrapped here, after it is set.
        # tests/integration/test_metrics_bounded.py fails if this stops being called.
        pool: Any = getattr(getattr(parent, "pool", None), "_pool", None)
        process_down = getattr(pool, "on_process_down", None)
        if process_down is None:
            return  # not prefork: no children

        def on_process_down(proc: Any) -> None:
            process_down(proc)
            if proc.pid is not None:
                worker_metrics.on_child_exit(proc.pid)

        pool.on_process_down = on_process_down


def install(app: Any) -> None:
    """Add our consumer steps to ``app`` (once per app), and the start-up check."""
    if app in _installed:
        return
    app.steps["consumer"].add(RecordUndecodable)
    app.steps["consumer"].add(RefuseMisshapen)
    app.steps["consumer"].add(LeaseKeeper)
    app.steps["consumer"].add(ArchiveDeadChildMetrics)
    _installed.add(app)
    # Celery's "raised unexpected" line keeps its text, not a second copy of the
    # traceback our attempt line logged (job_log.OneTraceback).
    logging.getLogger("celery.app.trace").addFilter(job_log.one_traceback)
    # Versions first: on an untested Celery the checks themselves may not be trustworthy.
    signals.worker_init.connect(refuse_untested_versions, dispatch_uid=__name__ + ".versions")
    signals.worker_init.connect(refuse_on_check_errors, dispatch_uid=__name__ + ".checks")
    # Before the consumer connects: kombu sweeps once as its event loop registers.
    signals.worker_init.connect(on_worker_init, dispatch_uid=__name__ + ".clock")
    # EXPLICIT_WORKER_METRICS_PORT: the pool's metrics, served by the main process.
    signals.worker_init.connect(worker_metrics.on_worker_init, dispatch_uid=__name__ + ".m")
    signals.worker_ready.connect(worker_metrics.on_worker_ready, dispatch_uid=__name__ + ".m")
    # Each task's key template, and a warning for one renamed since the last start.
    signals.worker_ready.connect(key_history.on_worker_ready, dispatch_uid=__name__ + ".keys")
    # A prefork child runs one job at a time: its Redis client keeps one connection.
    signals.worker_process_init.connect(
        redis_state.one_job_at_a_time, dispatch_uid=__name__ + ".redis"
    )


def import_tasks(app: Any) -> None:
    """Import each installed Django app's ``tasks`` module and finalize ``app``, as a
    worker loads them (Celery's Django autodiscovery imports the same modules); the
    ``ContractError`` of the first task refused.

    A module refused once is not imported again in this process. Python keeps no module
    whose import failed, so importing it again runs it again and registers again every
    task it declared above the refused one: Celery's DuplicateTaskNameWarning for each,
    once per check that loads the tasks. The first refusal is raised again instead.

    In a starting worker, a refusal ends the process here (``refuse_contract``): Celery's
    Django fixup runs the checks, and so this, before Celery imports the task modules
    itself and lets the error out as a traceback, before ``worker_init``.
    """
    refused = _refused.get(app)
    if refused is None:
        from django.utils.module_loading import autodiscover_modules

        try:
            autodiscover_modules("tasks")
            app.finalize(auto=True)
            return
        except ContractError as exc:
            _refused[app] = refused = exc
    if _worker_starting(app):
        refuse_contract(refused)
    raise refused


def _worker_starting(app: Any) -> bool:
    # Celery's loader sets this in ``init_worker``, just before it imports the task
    # modules (celery/loaders/base.py): only ``celery worker`` gets there.
    return bool(getattr(app.loader, "worker_initialized", False))


def refuse_contract(error: ContractError) -> None:
    """End a starting worker on a refused task: one line on stderr (the task, what is
    wrong, what to write instead), exit status 1, no traceback.

    No setting starts a worker despite it: the task's module cannot be imported.
    """
    message = f"worker refuses to start: {error}"
    # Most messages say the fix already ("declare at least 90s"); a hint that only
    # repeats the message's example ("Declare it on the task: <example>") is left out.
    if error.hint and (error.hint.partition(": ")[2] or error.hint) not in message:
        message += f" (hint: {error.hint})"
    message = message.replace("\n", " ")
    logger.critical(message)
    if not _logged_to_stderr(logger.logger):
        print(message, file=sys.stderr, flush=True)
    # SystemExit is not an Exception: neither Django's checks nor Celery's signals
    # (which log and return an Exception a receiver raises) stop it.
    raise SystemExit(1)


def refuse_on_check_errors(sender: Any = None, **_: Any) -> None:
    """``worker_init``: a worker whose configuration ``manage.py check`` rejects does not
    start (contracts are checked at start-up, not only when someone runs check).

    Celery's Django fixup runs the checks too but ignores what they find, and Celery's
    signals log an exception a receiver raises instead of stopping; ``SystemExit`` is
    not an ``Exception``, so it ends ``celery worker`` with status 1 here.
    """
    app = getattr(sender, "app", None)
    if app is None or app not in _installed:
        return
    from django.core.checks import ERROR, run_checks

    found = [m for m in run_checks() if m.level >= ERROR and str(m.id).startswith(CHECK_PREFIX)]
    if not found:
        return
    lines = "\n".join(f"  {m.id}: {m.msg} (hint: {m.hint})" for m in found)
    if settings.start_despite_check_errors:
        logger.warning(
            "starting despite check errors (EXPLICIT_START_DESPITE_CHECK_ERRORS):\n%s", lines
        )
        return
    message = (
        f"worker refuses to start: manage.py check reports {len(found)} error(s):\n{lines}\n"
        "Fix them, or set EXPLICIT_START_DESPITE_CHECK_ERRORS = True to start anyway."
    )
    logger.critical(message)
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(1)


def refuse_untested_versions(sender: Any = None, **_: Any) -> None:
    """``worker_init``: a worker on a Celery or kombu outside the tested ranges
    (``celery_explicit.versions.TESTED``) does not start, unless
    ``EXPLICIT_ALLOW_UNTESTED_VERSIONS`` is set.

    Our bootsteps wrap Celery internals that a minor release may change; one line at
    start-up names both versions instead of a wrong behaviour found in production.
    ``SystemExit`` ends ``celery worker`` with status 1 (see ``refuse_on_check_errors``).
    """
    app = getattr(sender, "app", None)
    if app is None or app not in _installed:
        return
    line = versions.untested_line(versions.installed())
    if line is None:
        return
    if settings.allow_untested_versions:
        logger.warning(
            "starting with untested versions (EXPLICIT_ALLOW_UNTESTED_VERSIONS): %s", line
        )
        return
    message = (
        f"worker refuses to start: {line}; "
        "set EXPLICIT_ALLOW_UNTESTED_VERSIONS = True to start anyway"
    )
    logger.critical(message)
    # One line on the terminal: printed only when the log record did not go there.
    if not _logged_to_stderr(logger.logger):
        print(message, file=sys.stderr, flush=True)
    raise SystemExit(1)


def _logged_to_stderr(log: logging.Logger) -> bool:
    """Whether a CRITICAL record of ``log`` reaches stderr: a stream handler on its way
    up writes there, or no handler at all does and ``logging.lastResort`` (stderr) takes
    it. At ``worker_init`` Celery has not set up its logging yet: usually the latter."""
    current: logging.Logger | None = log
    handled = False
    while current is not None:
        for handler in current.handlers:
            handled = True
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr:
                return True
        if not current.propagate:
            break
        current = current.parent
    return not handled and logging.lastResort is not None
