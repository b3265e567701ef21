"""``ExplicitTask``: a Celery task whose contract is declared on the task itself.

Subclass it (or pass ``base=ExplicitTask`` to ``@app.task``) and declare::

    idempotency_key = "payment:{payment_id}:capture"  # the effect's business identity
    visibility_timeout = 60   # seconds: the lease on this task's message
    expected_duration = 5     # seconds: a normal run
    retry_on = (GatewayTimeout,)   # transient: retry with capped, jittered backoff
    fail_on = (CardDeclined,)      # permanent: dead letter after one attempt

This module holds the declarations and the two doors: ``apply_async`` (our headers
stamped, the key among them: ``celery_explicit.headers.stamp``; bad input refused
before anything is sent; the dedup id and the entity's place claimed) and
``__call__``, which hands a delivered message to the job path
(``celery_explicit.pipeline``: one step per declared mechanism, then the handler, its
error classified, one attempt row).
"""

from __future__ import annotations

import copy
import inspect
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

from celery import Task, current_task
from celery.exceptions import Retry

from celery_explicit import (
    bootsteps,
    cancellation,
    effects,
    keys,
    pipeline,
    republish,
    tracing,
)
from celery_explicit import contract as contract_mod
from celery_explicit import dedup as dedup_mod
from celery_explicit import ordering as ordering_mod
from celery_explicit import sensitive as sensitive_mod
from celery_explicit.errors import BadInput, ContractError, ExplicitError
from celery_explicit.execution import Execution, current, running
from celery_explicit.headers import REPLAY_HEADER, stamp
from celery_explicit.request import ExplicitRequest

if TYPE_CHECKING:
    from celery_explicit.steps import Step
    from celery_explicit.store import Effect


class ExplicitTask(Task):  # type: ignore[type-arg]
    """Base class for tasks with an explicit contract. See the module docstring."""

    # Fixed for every ExplicitTask; contract.build refuses other values.
    acks_late = True
    reject_on_worker_lost = True
    serializer = "json"
    # Celery's own retry limit (3 by default) would end the 4th retry by re-raising the
    # error: a failed task, not retried, not dead-lettered, with a retry_scheduled row
    # claiming otherwise. max_attempts is the limit.
    max_retries = None
    # Runs in the worker's main process; records what never reaches run().
    Request = "celery_explicit.request:ExplicitRequest"

    # Declarations. None means "not declared": contract.build refuses it.
    idempotency_key: ClassVar[keys.KeyDeclaration | None] = None
    visibility_timeout: ClassVar[float | None] = None
    expected_duration: ClassVar[float | None] = None
    retry_on: ClassVar[tuple[type[BaseException], ...] | None] = None
    fail_on: ClassVar[tuple[type[BaseException], ...] | None] = None
    dedup_key: ClassVar[keys.KeyDeclaration | None] = None
    dedup_window: ClassVar[float | None] = None
    ordering_key: ClassVar[keys.KeyDeclaration | None] = None
    ordering_gap: ClassVar[float | None] = None
    unclassified: ClassVar[str] = "permanent"
    sensitive: ClassVar[tuple[str, ...]] = ()
    max_attempts: ClassVar[int] = 5
    backoff_base: ClassVar[float] = 1.0
    backoff_cap: ClassVar[float] = 60.0

    contract: ClassVar[contract_mod.Contract]
    #: The declared mechanisms' steps, in the order they run (``pipeline``).
    job_steps: ClassVar[tuple[Step, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # An intermediate base (shared settings for a family of tasks) declares
        # ``abstract = True`` and is validated through its concrete subclasses.
        if cls.__dict__.get("abstract"):
            return
        cls.contract = contract_mod.build(cls, cls.__dict__)
        cls.job_steps = pipeline.build_steps(cls.contract)
        if cls.contract.rate_limit is not None:
            # Ours, kept in the contract: Celery's worker reads ``rate_limit`` for its
            # per-worker token bucket and would not know what to do with it.
            cls.rate_limit = None
        # Errors the task declared (and our own, dead-lettered with their reason) are
        # expected: Celery logs them in one INFO line, no traceback, instead of
        # "raised unexpected"; our attempt line says what happened. Only errors
        # nobody classified keep Celery's ERROR and traceback.
        retry = cls.contract.retry
        throws: tuple[type[BaseException], ...] = (
            *retry.fail_on,
            *retry.retry_on,
            ExplicitError,
            *cls.__dict__.get("throws", ()),
        )
        cls.throws = throws  # type: ignore[assignment]  # Celery's stub says Exception
        limit = cls.contract.max_run_time
        if limit is not None and "time_limit" not in cls.__dict__:
            # Celery's soft limit raises SoftTimeLimitExceeded in the handler (recorded
            # as max_run_time); the hard limit, a little later, kills a handler that
            # ignores it (recorded by ExplicitRequest.on_timeout).
            cls.soft_time_limit = limit  # type: ignore[assignment]  # Celery takes floats
            cls.time_limit = limit + max(1.0, 0.1 * limit)  # type: ignore[assignment]

    @classmethod
    def on_bound(cls, app: Any) -> None:
        # Our consumer bootsteps (leases, undecodable bodies), once per app.
        bootsteps.install(app)
        super().on_bound(app)

    # --- publishing ---------------------------------------------------------------

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Publish with the rendered key in the headers; bad input never leaves the caller.

        The key travels from the moment of publishing, so a consumer, a log line or a
        downstream sees the same key the ledger will use.
        """
        headers = dict(options.pop("headers", None) or {})
        dedup_claim: tuple[str, str] | None = None
        order_key: str | None = None
        taken_place: tuple[str, int] | None = None
        republishing = bool(options.pop(republish.OPTION, False))
        if republishing:
            # Re-publishing this job (a retry, a deferral): it keeps its key, its place
            # and its dedup claim (same task id); nothing is checked again.
            republish.carry_headers(self.request, headers)
        # Our headers, as the outbox relay stamps them too; bad input raises here,
        # before anything is claimed.
        given = stamp(self, args, kwargs, headers, options, republish=republishing)
        if given is not None:
            ordering = self.contract.ordering
            if ordering is not None:
                # Rendered before anything is claimed: bad input claims nothing.
                order_key = keys.render_key(self.name, ordering.key, given, label="ordering key")
                running_place = ordering_mod.place_of(self.request)
                if running_place is not None and task_id and task_id == self.request.id:
                    # The handler's own self.retry(): the same job keeps its place.
                    order_key = None
                    headers.update(ordering_mod.place_headers(running_place))
            limit = self.contract.rate_limit
            if limit is not None:
                # Bad input is refused here, not on the worker.
                keys.render_key(self.name, limit.key, given, label="rate limit key")
            dedup = self.contract.dedup
            if dedup is not None and REPLAY_HEADER not in headers:
                task_id = task_id or str(uuid.uuid4())
                owner, dedup_id = dedup_mod.claim_at_publish(
                    self.name, dedup.key, given, task_id, window=dedup.window
                )
                if owner != task_id:
                    return self.AsyncResult(owner)  # dropped: the first message's handle
                dedup_claim = (dedup_id, task_id)
        try:
            if order_key is not None:
                taken_place = (order_key, ordering_mod.take_number(order_key))
                headers.update(ordering_mod.place_headers(taken_place))
            with tracing.publish(self.name, task_id, headers) as task_id:
                return super().apply_async(
                    args,
                    kwargs,
                    task_id,
                    producer,
                    link,
                    link_error,
                    shadow,
                    headers=headers,
                    **options,
                )
        except BaseException:
            if taken_place is not None:
                # Never published: the jobs behind it in its entity must not wait for it.
                ordering_mod.give_back(*taken_place)
            if dedup_claim is not None:
                # Nothing was published: give the id back, or every resend inside the
                # window would be dropped in favour of a job that does not exist.
                dedup_mod.release(self.name, *dedup_claim)
            raise

    def bind_arguments(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(all arguments with defaults, the arguments the caller gave) or BadInput."""
        bound_plainly = self.contract.binder.bind(args, kwargs)
        if bound_plainly is not None:
            return bound_plainly
        sig = self.contract.signature
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise BadInput(self.name, f"arguments do not fit run{sig}: {exc}") from None
        given = dict(bound.arguments)
        for name, param in sig.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD and name in given:
                given.update(given.pop(name))
        bound.apply_defaults()
        return dict(bound.arguments), given

    # --- executing ----------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:
            # A plain function call (a unit test, a shell): no message, no attempt row,
            # but the same key so ``effect()`` still guards the effect.
            pipeline.begin(self, request, args, kwargs)
            return super().__call__(*args, **kwargs)
        try:
            return pipeline.deliver(self, args, kwargs)
        finally:
            if self.contract.sensitive:
                # Celery stores the request's arguments with the result once this
                # returns (``result_extended``) and hands them to on_failure and the
                # errbacks: the redacted ones. Every re-publish (a retry, a deferral)
                # has been sent by now, from the real ones.
                shown = sensitive_mod.of_call(
                    self.contract.sensitive, self.contract.signature, args, kwargs
                )
                request.args, request.kwargs = shown.arguments(args, kwargs)

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: Any = None,
        throw: bool = True,
        eta: Any = None,
        countdown: Any = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's ``retry``, with the error's text scrubbed of sensitive values.

        Celery logs the error it is handed (``Task ... retry: Retry in 2s: <error>``)
        and stores it as the RETRY state: it gets a copy without them; the error the
        handler raised is left as it is.
        """
        execution = running(self.request)
        shown = exc
        if execution is not None and execution.secrets and isinstance(exc, BaseException):
            shown = sensitive_mod.Redaction(
                fields=execution.sensitive, secrets=tuple(execution.secrets)
            ).error(exc)
        if shown is exc or self.request.called_directly:
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        try:
            return super().retry(args, kwargs, shown, throw, eta, countdown, max_retries, **options)
        except Retry as retry:
            # Raised while the handler's error was being handled, the Retry chains it
            # (``__context__``), and the traceback Celery stores with the RETRY state
            # would quote it: the scrubbed copy stands for it.
            retry.__suppress_context__ = True
            raise

    @property
    def backend(self) -> Any:
        """Celery's result backend; for a task with sensitive fields whose results keep
        their arguments (``result_extended``), one that stores them redacted.

        Celery stores the STARTED state (``task_track_started``) with the request's
        arguments before the handler runs, while ``request.args`` must still be the
        real ones (a retry publishes from them): the store is where they are redacted.
        """
        backend = Task.backend.fget(self)  # type: ignore[attr-defined]
        contract = getattr(type(self), "contract", None)  # None: the base class itself
        if contract is None or not contract.sensitive or not self.app.conf.result_extended:
            return backend
        return _RedactedStore(backend, contract)

    @backend.setter
    def backend(self, value: Any) -> None:
        Task.backend.fset(self, value)  # type: ignore[attr-defined]

    def run_handler(self, *args: Any, **kwargs: Any) -> Any:
        """The handler itself, as Celery runs it (``run()``); called by the pipeline."""
        return super().__call__(*args, **kwargs)

    # --- the handler's tools ------------------------------------------------------

    @contextmanager
    def effect(self, *, using: str | None = None) -> Iterator[Effect]:
        """The effect and its ledger row in one transaction (``celery_explicit.effects``)."""
        with effects.effect_of(self, using=using) as claimed:
            yield claimed

    @property
    def fencing_token(self) -> int | None:
        """This execution's fencing token, for your own guarded writes
        (``django_outbox.store.guarded_writes.fenced_update``); None without an execution lease."""
        return current(self.request, self.name).fence

    @property
    def cancelled(self) -> bool:
        """Has an operator cancelled this job? Read from the state store at most once
        every quarter of the lease (``celery_explicit.cancellation``); True stays True.
        Stop early if you can: the effect's commit is refused for a cancelled job
        either way. Only for a task that declares ``cancellable = True``."""
        contract = self.contract
        if not contract.cancellable:
            raise ContractError(
                self.name,
                "self.cancelled is read, but the task does not declare cancellable = True",
                field="cancellable",
                hint="Declare cancellable = True on the task class",
            )
        execution = current(self.request, self.name)
        if execution.cancel_watch is None:
            execution.cancel_watch = cancellation.Watch(
                execution.task_id, execution.key, period=max(0.5, contract.visibility_timeout / 4)
            )
        return bool(execution.cancel_watch.cancelled())

    def set_external_request_id(self, value: str) -> None:
        """Record the downstream's request id on this attempt (for its support desk)."""
        current(self.request, self.name).external_request_id = str(value)


@contextmanager
def effect(*, using: str | None = None) -> Iterator[Effect]:
    """``self.effect()`` for handlers declared with ``@app.task`` without ``bind=True``."""
    task = current_task
    if not isinstance(task, ExplicitTask):  # current_task is a proxy; isinstance sees through
        raise ExplicitError("effect() works only inside a running ExplicitTask")
    with task.effect(using=using) as claimed:
        yield claimed


__all__ = ["Execution", "ExplicitRequest", "ExplicitTask", "effect"]


class _RedactedStore:
    """A result backend whose ``store_result`` keeps a sensitive task's arguments
    redacted (``ExplicitTask.backend``); everything else is the backend's own."""

    def __init__(self, backend: Any, contract: Any) -> None:
        self._backend, self._contract = backend, contract

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def store_result(
        self,
        task_id: Any,
        result: Any,
        state: Any,
        traceback: Any = None,
        request: Any = None,
        **kwargs: Any,
    ) -> Any:
        if request is not None and (
            getattr(request, "args", None) or getattr(request, "kwargs", None)
        ):
            args, kw = tuple(request.args or ()), dict(request.kwargs or {})
            shown = sensitive_mod.of_call(
                self._contract.sensitive, self._contract.signature, args, kw
            )
            request = copy.copy(request)
            request.args, request.kwargs = shown.arguments(args, kw)
        return self._backend.store_result(
            task_id, result, state, traceback, request=request, **kwargs
        )
