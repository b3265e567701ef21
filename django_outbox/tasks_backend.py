"""A ``django.tasks`` backend whose tasks keep celery-explicit's contract (Django 6.1+).

::

    TASKS = {"default": {"BACKEND": "django_outbox.tasks_backend.ExplicitBackend"}}

    @task(
        idempotency_key="receipt:{order_id}",
        visibility_timeout=60,
        expected_duration=5,
        retry_on=(SmtpTimeout,),
        fail_on=(InvalidAddress,),
    )
    def send_receipt(order_id: int) -> None:
        with effect() as e:
            ...

- Declaring: Django 6.1 hands the decorator's extra keyword arguments to the backend's
  task class (``ExplicitDjangoTask``). ``validate_task`` builds from the function and
  its declarations the ExplicitTask that runs it on the worker, named after the
  function's module path, and registers it with the Celery app (``EXPLICIT_CELERY_APP``).
  The contract is celery_explicit's own (``contract.build``): a missing or contradictory
  declaration raises ``ContractRefused`` at decoration, naming the task, the field and
  the fix. It is both Django's ``InvalidTask`` and our ``ContractError``, so
  ``manage.py check`` reports it as ``django_outbox.E001`` when the function lives in
  an app's ``tasks.py``.
- Enqueueing: through ``dispatch()``: published after the transaction commits, or,
  declared ``durable=True``, an outbox row written in the transaction for the relay.
- Results: ``enqueue()`` returns a READY ``TaskResult`` whose id is the job's (the
  Celery task id: the attempt rows, the dead letters, ``explicit_explain`` and the admin
  know the job by it). There is no ``get_result``: the attempt rows keep how each
  execution ended but neither the return value nor the arguments, so a ``TaskResult``
  built from them would report a SUCCESSFUL job's return value as None.

Django 5.2 has no ``django.tasks``: this module is for Django 6.1 and later only, and
nothing of the package imports it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import django

if django.VERSION < (6, 1):
    raise ImportError(
        "django_outbox.tasks_backend needs Django 6.1 or later: the @task decorator "
        "passes a backend's declarations through from 6.1 on; this is Django "
        f"{django.get_version()}"
    )

from django.tasks import DEFAULT_TASK_QUEUE_NAME, Task, TaskResult, TaskResultStatus
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.exceptions import InvalidTask
from django.utils import timezone

from celery_explicit import keys
from celery_explicit.errors import ContractError
from celery_explicit.task import ExplicitTask
from django_outbox.conf import settings
from django_outbox.outbox.dispatch import dispatch

__all__ = ["ContractRefused", "ExplicitBackend", "ExplicitDjangoTask"]

if TYPE_CHECKING:
    _Task = Task[..., Any]
else:
    # Django's Task is a plain dataclass at run time; only its stub is generic.
    _Task = Task


class ContractRefused(InvalidTask, ContractError):
    """A ``django.tasks`` task whose contract celery_explicit refuses. Django's
    ``InvalidTask`` for the decorator's callers, our ``ContractError`` for
    ``manage.py check`` (E001), with the task, the field and the fix."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExplicitDjangoTask(_Task):
    """``@task(...)``'s task with celery-explicit's declarations (see ``ExplicitTask``).

    None means "not declared": the five the contract requires are refused then; the
    others keep the contract's defaults.
    """

    idempotency_key: keys.KeyDeclaration | None = None
    visibility_timeout: float | None = None
    expected_duration: float | None = None
    retry_on: tuple[type[BaseException], ...] | None = None
    fail_on: tuple[type[BaseException], ...] | None = None
    unclassified: str | None = None
    max_attempts: int | None = None
    backoff_base: float | None = None
    backoff_cap: float | None = None
    max_deliveries: int | None = None
    max_run_time: float | None = None
    #: Enqueue through the outbox (a row in the caller's transaction, published by
    #: the relay) rather than after commit: for jobs that must not be lost.
    durable: bool = False

    def declarations(self) -> dict[str, Any]:
        """The contract's declarations this task made (the ExplicitTask's options)."""
        declared = {name: getattr(self, name) for name in _DECLARATIONS}
        return {name: value for name, value in declared.items() if value is not None}


#: The fields of ExplicitDjangoTask that are ExplicitTask options (not ``durable``,
#: which says how to enqueue).
_DECLARATIONS = tuple(
    f.name
    for f in fields(ExplicitDjangoTask)
    if f.name not in {g.name for g in fields(Task)} and f.name != "durable"
)


#: A decorator-form fix for each field the contract requires (the key's: ``_key_example``).
_EXAMPLES = {
    "visibility_timeout": "visibility_timeout=60",
    "expected_duration": "expected_duration=5",
    "retry_on": "retry_on=(TimeoutError,)",
    "fail_on": "fail_on=(ValueError,)",
}


class ExplicitBackend(BaseTaskBackend):
    """Runs ``django.tasks`` tasks as ExplicitTasks on Celery workers."""

    task_class = ExplicitDjangoTask
    # run_after: an outbox row keeps no delay (outbox.events.STORED_OPTIONS: it would
    # count from the relay's publish), and a task must not mean one thing when durable
    # and another when not. Not offered, rather than honoured on one path only.
    supports_defer = False
    # The handler runs in a prefork worker process: no event loop to run a coroutine.
    supports_async_task = False
    # Brokers disagree on what a priority means (RabbitMQ 0-255 per queue, Redis 0-9
    # emulated by extra queues); django.tasks' -100..100 maps onto neither.
    supports_priority = False
    # See the module docstring: the rows keep no return value and no arguments.
    supports_get_result = False

    def validate_task(self, task: Task[..., Any]) -> None:
        super().validate_task(task)
        if not isinstance(task, ExplicitDjangoTask):
            raise InvalidTask(
                f"Task {task.module_path}: ExplicitBackend runs only tasks made by its "
                "task class (@task(...) with this backend's alias), which carry the "
                "contract's declarations"
            )
        if task.takes_context:
            raise InvalidTask(
                f"Task {task.module_path}: takes_context=True is not supported by "
                "ExplicitBackend; the attempt number and the key are in the job's log "
                "lines and attempt rows"
            )
        explicit_task(task)

    def enqueue(
        self, task: Task[Any, Any], args: list[Any], kwargs: dict[str, Any]
    ) -> TaskResult[Any, Any]:
        # Django validated the task when it was made (``Task.__post_init__``, and again
        # for each ``using()`` copy); a task object is frozen, so only the ExplicitTask
        # it runs as is looked up here, built once (``explicit_task``).
        if not isinstance(task, ExplicitDjangoTask):
            self.validate_task(task)  # refuses it with InvalidTask, naming the task
            raise AssertionError(task)
        options = {} if task.queue_name == DEFAULT_TASK_QUEUE_NAME else {"queue": task.queue_name}
        # Raises BadInput here, in the caller's transaction, for arguments the
        # handler could not take or the key could not be rendered from.
        job_id = dispatch(explicit_task(task), args, kwargs, durable=task.durable, options=options)
        return TaskResult(
            task=task,
            id=job_id,
            status=TaskResultStatus.READY,
            enqueued_at=timezone.now(),
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=list(args),
            kwargs=dict(kwargs),
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )


#: The ExplicitTask each (app, function, declarations) runs as, once built: an enqueue
#: looks it up instead of going through Celery's decorator again (about 100 µs a job,
#: bench/django_tasks_cost.py).
_built: dict[tuple[int, Any, tuple[tuple[str, Any], ...]], ExplicitTask] = {}


def explicit_task(task: ExplicitDjangoTask) -> ExplicitTask:
    """The ExplicitTask that runs ``task`` on the workers, registered with the Celery
    app under the function's module path; built on first use (``ContractRefused``)."""
    app = settings.celery_app()
    declared = task.declarations()
    try:
        cache_key = (id(app), task.func, tuple(sorted(declared.items())))
        hash(cache_key)
    except TypeError:  # a declaration that cannot be hashed: built every time
        return _build(app, task, declared)
    found = _built.get(cache_key)
    if found is None or app.tasks.get(found.name) is not found:
        found = _built[cache_key] = _build(app, task, declared)
    return found


def _build(app: Any, task: ExplicitDjangoTask, declared: dict[str, Any]) -> ExplicitTask:
    name = task.module_path
    try:
        # Celery's own decorator, as ``@app.task(base=ExplicitTask, ...)`` would: the
        # class is built (and its contract checked) at once (lazy=False), on this app
        # only (shared=False); a name already registered is handed back as it is.
        decorate: Any = app.task(base=ExplicitTask, name=name, shared=False, lazy=False, **declared)
        registered = decorate(task.func)
    except ContractError as exc:
        raise _refused(exc, task) from exc
    built_from = vars(type(registered))
    others = any(built_from.get(field) != declared.get(field) for field in _DECLARATIONS)
    if getattr(registered, "_decorated_fun", None) is not task.func or others:
        # A second @task over the same path (or a reloaded module) would otherwise run
        # under the first one's contract, without a word.
        raise ContractRefused(
            name,
            "a task of this name is already registered with the Celery app, from "
            "another function or other declarations; one name runs one contract",
            field="name",
            hint="Give each django.tasks function its own module path",
        )
    assert isinstance(registered, ExplicitTask)
    return registered


def _refused(exc: ContractError, task: ExplicitDjangoTask) -> ContractRefused:
    message = str(exc).removeprefix(f"Task {exc.task_name}: ")
    hint = exc.hint
    if exc.field and message.startswith("missing declaration"):
        example = _EXAMPLES.get(exc.field) or _key_example(task)
        hint = f"Declare it in the decorator: @task({example}, ...)"
    elif exc.field:
        hint = hint or f"Fix {exc.field}= in the task's @task(...) decorator"
    return ContractRefused(exc.task_name, message, field=exc.field, hint=hint)


def _key_example(task: ExplicitDjangoTask) -> str:
    """An idempotency key from the function's own name and first parameter."""
    params = [p for p in inspect.signature(task.func).parameters if p != "context"]
    field = f"{{{params[0]}}}" if params else "{some_id}"
    return f"idempotency_key='{task.func.__name__}:{field}'"
