"""``ExplicitTask``: a Celery task whose contract is declared on the task itself.

Subclass it (or pass ``base=ExplicitTask`` to ``@app.task``) and declare::

    idempotency_key = "payment:{payment_id}:capture"  # the effect's business identity
    visibility_timeout = 60   # seconds: the lease on this task's message
    expected_duration = 5     # seconds: a normal run
    retry_on = (GatewayTimeout,)   # transient: retry with capped, jittered backoff
    fail_on = (CardDeclined,)      # permanent: dead letter after one attempt

Every execution is wrapped here: the arguments are bound to ``run()``'s signature and
the key rendered (bad input is dead-lettered on its first delivery, never retried),
the handler runs, its error is classified, and one attempt row records how it ended.
"""

from __future__ import annotations

import inspect
import logging
import os
import random
import traceback as tb
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

from celery import Task, current_task
from celery.exceptions import Ignore, InvalidTaskError, Reject, Retry, SoftTimeLimitExceeded
from celery.worker.request import Request
from django.db import DatabaseError, connections
from django.db import Error as DjangoDbError
from django.utils import timezone

from celery_explicit import contract as contract_mod
from celery_explicit import dedup as dedup_mod
from celery_explicit import delivery_limit, execution_lease, idempotency, metrics
from celery_explicit import downstream as downstream_mod
from celery_explicit import ordering as ordering_mod
from celery_explicit.errors import (
    BadInput,
    DeliveryLimitExceeded,
    ExplicitError,
    IdempotencyConflict,
    LeaseLost,
    qualname,
)
from celery_explicit.retry_policy import Classification

if TYPE_CHECKING:
    from django_outbox.ledger import Effect
    from django_outbox.models import DeadLetterReason, Outcome

logger = logging.getLogger("celery_explicit")
#: apply_async option marking a retry's re-publish (popped before Celery sees it).
_RETRY_OPTION = "_explicit_retry"
_rng = random.SystemRandom()


@dataclass
class Execution:
    """What one execution knows about itself; kept on ``task.request.explicit``."""

    task_id: str
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
    Request = "celery_explicit.task:ExplicitRequest"

    # Declarations. None means "not declared": contract.build refuses it.
    idempotency_key: ClassVar[idempotency.KeyDeclaration | None] = None
    visibility_timeout: ClassVar[float | None] = None
    expected_duration: ClassVar[float | None] = None
    retry_on: ClassVar[tuple[type[BaseException], ...] | None] = None
    fail_on: ClassVar[tuple[type[BaseException], ...] | None] = None
    dedup_key: ClassVar[idempotency.KeyDeclaration | None] = None
    dedup_window: ClassVar[float | None] = None
    ordering_key: ClassVar[idempotency.KeyDeclaration | None] = None
    ordering_gap: ClassVar[float | None] = None
    unclassified: ClassVar[str] = "permanent"
    max_attempts: ClassVar[int] = 5
    backoff_base: ClassVar[float] = 1.0
    backoff_cap: ClassVar[float] = 60.0

    contract: ClassVar[contract_mod.Contract]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # An intermediate base (shared settings for a family of tasks) declares
        # ``abstract = True`` and is validated through its concrete subclasses.
        if cls.__dict__.get("abstract"):
            return
        cls.contract = contract_mod.build(cls, cls.__dict__)
        limit = cls.contract.max_run_time
        if limit is not None and "time_limit" not in cls.__dict__:
            # Celery's soft limit raises SoftTimeLimitExceeded in the handler (recorded
            # as max_run_time); the hard limit, a little later, kills a handler that
            # ignores it (recorded by ExplicitRequest.on_timeout).
            cls.soft_time_limit = limit  # type: ignore[assignment]  # Celery takes floats
            cls.time_limit = limit + max(1.0, 0.1 * limit)  # type: ignore[assignment]

    @classmethod
    def on_bound(cls, app: Any) -> None:
        # Messages that never reach a task (an undecodable body) are dead-lettered by
        # a consumer step; every app running an ExplicitTask gets it.
        from celery_explicit import lease, worker_steps

        worker_steps.install(app)
        lease.install(app)
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
        if options.pop(_RETRY_OPTION, False):
            # Re-publishing this job for a retry or a deferral: its arguments were bound
            # and its key rendered when it started, and it keeps its dedup claim (same
            # task id). Nothing here may fail, or Celery would drop the message.
            self._carry_headers(headers)
        else:
            _arguments, given = self.bind_arguments(tuple(args or ()), dict(kwargs or {}))
            headers[idempotency.KEY_HEADER] = idempotency.render_key(
                self.name, self.contract.idempotency_key, given
            )
            ordering = self.contract.ordering
            if ordering is not None:
                # Rendered before anything is claimed: bad input claims nothing.
                order_key = idempotency.render_key(
                    self.name, ordering.key, given, label="ordering key"
                )
                running_place = ordering_mod.place_of(self.request)
                if running_place is not None and task_id and task_id == self.request.id:
                    # The handler's own self.retry(): the same job keeps its place.
                    order_key = None
                    headers.update(ordering_mod.place_headers(running_place))
            dedup = self.contract.dedup
            if dedup is not None and idempotency.REPLAY_HEADER not in headers:
                task_id = task_id or str(uuid.uuid4())
                dedup_id = idempotency.render_key(self.name, dedup.key, given, label="dedup key")
                owner = dedup_mod.claim(self.name, dedup_id, task_id, window=dedup.window)
                if owner != task_id:
                    # Dropped: nothing is published; the caller gets the first
                    # message's result handle.
                    metrics.dedup_dropped.labels(self.name, "publish").inc()
                    logger.info(
                        "dedup: message dropped at publish",
                        extra={
                            "task": self.name,
                            "dedup_id": dedup_id,
                            "job_id": owner,
                            "layer": "delivery",
                        },
                    )
                    return self.AsyncResult(owner)
                dedup_claim = (dedup_id, task_id)
            if idempotency.CORRELATION_HEADER not in headers and current_task:
                correlation = getattr(current_task.request, idempotency.CORRELATION_HEADER, None)
                if correlation:
                    headers[idempotency.CORRELATION_HEADER] = correlation
        try:
            if order_key is not None:
                seq = ordering_mod.take_number(order_key)
                taken_place = (order_key, seq)
                headers.update(ordering_mod.place_headers(taken_place))
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

    def _carry_headers(self, headers: dict[str, Any]) -> None:
        """The running job's own headers, for its re-publish (a retry, a deferral)."""
        request = self.request
        running = getattr(request, "explicit", None)
        if isinstance(running, Execution):
            headers[idempotency.KEY_HEADER] = running.key
            headers.setdefault(idempotency.CORRELATION_HEADER, running.correlation_id)
        replay = getattr(request, idempotency.REPLAY_HEADER, None)
        if replay is not None:
            # An operator's replay stays one: its dedup id is not a duplicate.
            headers.setdefault(idempotency.REPLAY_HEADER, replay)
        place = ordering_mod.place_of(request)
        if place is not None:
            # Its place in its entity's order does not change when it runs again.
            headers.update(ordering_mod.place_headers(place))

    def _retry(self, exc: Exception, countdown: float) -> Retry:
        """``self.retry`` that cannot lose the message.

        Celery turns a failed re-publish into ``Reject(requeue=False)``: the message
        would be dropped. Requeue it instead (it runs again at once rather than after
        its backoff, but it is not lost), and skip re-validation on the re-publish.
        """
        options: dict[str, Any] = {_RETRY_OPTION: True}
        if not self._hand_back_execution_lease():
            raise self._end_without_republishing("retry")
        try:
            retry: Retry = self.retry(exc=exc, countdown=countdown, **options)
        except Reject as reject:
            if getattr(reject, "requeue", False):
                raise
            logger.error(
                "retry could not be published; requeueing the message",
                extra={"task": self.name, "job_id": self.request.id},
            )
            raise Reject(getattr(reject, "reason", None), requeue=True) from exc
        return retry

    def bind_arguments(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(all arguments with defaults, the arguments the caller gave) or BadInput."""
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
            self._begin(request, args, kwargs)
            return super().__call__(*args, **kwargs)
        ends_job = True
        try:
            return self._deliver(request, args, kwargs)
        except (Retry, Ignore):
            # A retry is scheduled, or the job was deferred: it is not over yet. (Ignore
            # is also how a handler drops its own message; an ordered entity then waits
            # out its gap.)
            ends_job = False
            raise
        except Reject as reject:
            ends_job = not getattr(reject, "requeue", False)
            raise
        finally:
            execution = getattr(request, "explicit", None)
            if isinstance(execution, Execution) and execution.lost_lease:
                ends_job = False  # the job goes on in the execution that took it over
            if ends_job and self.contract.ordering is not None:
                self._pass_turn(request)

    def _deliver(self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        started = timezone.now()
        try:
            execution = self._begin(request, args, kwargs, started=started)
        except BadInput as exc:
            self._dead_letter_and_audit(
                request,
                args,
                kwargs,
                exc,
                started=started,
                key="",
                outcome_name="BAD_INPUT",
                reason_name="BAD_INPUT",
            )
            raise

        limit_hit = self._over_delivery_limit(execution, request)
        if limit_hit is not None:
            self._terminal(execution, request, args, kwargs, limit_hit, "DELIVERY_LIMIT")
            raise limit_hit

        if self.contract.dedup is not None and not self._claim_dedup(execution, request):
            return None

        if self.contract.ordering is not None:
            self._wait_for_turn(execution, request, args, kwargs)

        try:
            self._take_execution_lease(execution, request, args, kwargs)
            return self._run_leased(execution, request, args, kwargs)
        finally:
            if execution.fence is not None:
                self._release_execution_lease(execution)

    def _wait_for_turn(
        self, execution: Execution, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Run only when every earlier job of this entity has ended; defer otherwise."""
        import redis

        ordering = self.contract.ordering
        assert ordering is not None
        place = ordering_mod.place_of(request)
        if place is None:
            # Published without a number (before ordering_key was declared, or by
            # send_task): it has no place to wait for.
            return
        key, seq = place
        try:
            turn = ordering_mod.turn(key, seq, execution.task_id, gap=ordering.gap)
        except redis.RedisError:
            logger.warning(
                "ordering of %s unavailable: running out of turn",
                key,
                extra={"task": self.name, "job_id": execution.task_id},
            )
            return
        if turn.skipped_ahead:
            metrics.ordering_skipped.labels(self.name).inc()
            logger.warning(
                "ordering %s: jobs %s..%s never came within %.0fs; job %s goes ahead",
                key,
                turn.next_seq,
                seq - 1,
                ordering.gap,
                seq,
                extra={"task": self.name, "job_id": execution.task_id},
            )
        if turn.run:
            return
        metrics.ordering_deferred.labels(self.name).inc()
        delay = _rng.uniform(0.2, 1.0)
        self._log(
            f"deferred {delay:.2f}s: {key} job {seq} waits for job {turn.next_seq}",
            execution,
            layer="delivery",
            ordering_key=key,
        )
        self._defer(execution, request, args, kwargs, delay)

    def _pass_turn(self, request: Any) -> None:
        """This job ended for good: the next job of its entity may run."""
        _pass_turn_on(ordering_mod.place_of(request), task=self.name, job_id=request.id)

    def _run_leased(
        self, execution: Execution, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        admitted = self._enter_downstream(execution, request, args, kwargs)
        downstream_failed = False
        try:
            result = super().__call__(*args, **kwargs)
        except Retry:
            # The handler called self.retry() itself: an explicit decision, recorded.
            self._audit(execution, "RETRY_SCHEDULED")
            raise
        except SoftTimeLimitExceeded as exc:
            self._terminal(execution, request, args, kwargs, exc, "MAX_RUN_TIME")
            raise
        except IdempotencyConflict as exc:
            metrics.duplicates_absorbed.labels(self.name, "arguments").inc()
            self._terminal(execution, request, args, kwargs, exc, "CONFLICT")
            raise
        except LeaseLost as exc:
            # This execution lost its lease while paused and a newer one runs the job
            # now: nothing of this attempt committed, and the message is the newer
            # one's to finish. Recorded, not retried, not dead-lettered.
            metrics.fenced_commits.labels(self.name).inc()
            execution.lost_lease = True
            self._audit(execution, "FENCED", exc=exc)
            return None
        except Exception as exc:
            # Only a transient error counts against the downstream: a declined card is
            # an answer, and our own bug is not the warehouse's fault.
            downstream_failed = self.contract.retry.classify(exc) is Classification.RETRY
            self._handle_error(execution, request, args, kwargs, exc)
            raise
        finally:
            if admitted:
                self._leave_downstream(execution, failed=downstream_failed)
        if not execution.recorded:
            self._audit(execution, execution.outcome.name if execution.outcome else "SUCCEEDED")
        return result

    def _terminal(
        self,
        execution: Execution,
        request: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        exc: BaseException,
        name: str,
    ) -> None:
        """Dead-letter the message and record the attempt; outcome and reason share a name."""
        self._dead_letter_and_audit(
            request,
            args,
            kwargs,
            exc,
            started=execution.started_at,
            key=execution.key,
            outcome_name=name,
            reason_name=name,
            execution=execution,
        )

    def _take_execution_lease(
        self, execution: Execution, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Hold the job's execution lease, or defer this delivery (see execution_lease)."""
        import redis

        redelivered = bool(_delivery(request, "redelivered"))
        if not execution_lease.enabled():
            if redelivered:
                metrics.redeliveries.labels(self.name, "broker").inc()
            return
        try:
            lease = execution_lease.acquire(execution.task_id, ttl=self.contract.visibility_timeout)
        except redis.RedisError:
            # The lease is a safety net for a rare race: without Redis the job runs,
            # unfenced, loudly.
            logger.warning(
                "execution lease unavailable: running unfenced",
                extra={"task": self.name, "job_id": execution.task_id},
            )
            return
        if isinstance(lease, execution_lease.Held):
            metrics.concurrent_deferred.labels(self.name).inc()
            # Look again well before the holder's lease could run out: it may end soon.
            quarter = max(0.5, self.contract.visibility_timeout * 0.25)
            delay = min(lease.retry_in, quarter) + _rng.uniform(0.2, 1.0)
            self._log(
                f"deferred {delay:.2f}s: another execution of this job is running ({lease.holder})",
                execution,
                layer="delivery",
                holder=lease.holder,
            )
            self._defer(execution, request, args, kwargs, delay)
        execution.fence = lease.fence
        if lease.took_over_from:
            self._announce_takeover(execution, lease)
        elif redelivered:
            metrics.redeliveries.labels(self.name, "broker").inc()

    def _announce_takeover(self, execution: Execution, lease: execution_lease.Taken) -> None:
        metrics.redeliveries.labels(self.name, lease.cause).inc()
        self._log(
            f"took over the execution lease of {lease.took_over_from} ({lease.cause}); "
            f"fence {lease.fence}",
            execution,
            layer="delivery",
            fence=lease.fence,
        )
        try:
            execution_lease.record_takeover(
                execution.task_id, execution.key, lease.fence, lease.took_over_from
            )
        except DjangoDbError as exc:
            # Without the fence row the stale holder could still commit: do not run.
            # Keep the lease (it runs out by itself) rather than release it: releasing
            # would erase the "not released" marker, and the retry would then take a
            # fresh lease with no takeover to record.
            execution.fence = None
            raise self._retry(exc, _rng.uniform(1.0, 5.0)) from exc

    def _hand_back_execution_lease(self) -> bool:
        """Before re-publishing this job: its next message must find the lease free.

        False when the lease had been taken over meanwhile: another execution owns the
        job now, and this one must not publish a second live copy of it.
        """
        execution = getattr(self.request, "explicit", None)
        if isinstance(execution, Execution) and execution.fence is not None:
            self._release_execution_lease(execution)
            execution.fence = None
            return not execution.lost_lease
        return True

    def _end_without_republishing(self, what: str) -> Ignore:
        """The lease was lost: leave the job to the execution that took it over."""
        execution = self._execution()
        logger.warning(
            "%s not published: a newer execution of job %s took its lease over",
            what,
            execution.task_id,
            extra={"task": self.name, "job_id": execution.task_id},
        )
        return Ignore()

    def _release_execution_lease(self, execution: Execution) -> None:
        import redis

        assert execution.fence is not None
        try:
            released = execution_lease.release(execution.task_id, execution.fence)
        except redis.RedisError:
            logger.warning(
                "could not release the execution lease (it runs out by itself)",
                extra={"task": self.name, "job_id": execution.task_id},
            )
            return
        if not released:
            # Taken over while this execution ran (it was paused past its lease): the
            # job is the newer execution's now, its turn included.
            execution.lost_lease = True

    def _defer(
        self,
        execution: Execution,
        request: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        delay: float,
    ) -> NoReturn:
        """Publish the same job again ``delay`` seconds from now and end this delivery.

        Same task id and retry count, no attempt used; the pool slot is free at once.
        """
        again: dict[str, Any] = {_RETRY_OPTION: True}
        if not self._hand_back_execution_lease():
            raise self._end_without_republishing("deferral")
        try:
            self.apply_async(
                args,
                kwargs,
                task_id=execution.task_id,
                countdown=delay,
                retries=int(request.retries or 0),
                queue=_delivery(request, "routing_key"),
                **again,
            )
        except Exception as exc:
            raise Reject(exc, requeue=True) from exc
        raise Ignore()

    def _enter_downstream(
        self, execution: Execution, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> bool:
        """True if admitted to the declared downstream; defers the message (Ignore) if not."""
        import redis

        downstream = self.contract.downstream
        if downstream is None:
            return False
        try:
            verdict, state = downstream_mod.enter(
                downstream, execution.task_id, slot_lease=self.contract.visibility_timeout
            )
        except redis.RedisError:
            # The limits are a safety net: without Redis the job runs, loudly.
            logger.warning(
                "downstream %s: limits unavailable, running unguarded",
                downstream.name,
                extra={"task": self.name},
            )
            return False
        if verdict == "admitted":
            return True
        delay = _rng.uniform(0.5, 1.5) * downstream.defer_base
        metrics.downstream_deferred.labels(downstream.name, verdict).inc()
        self._log(
            f"deferred {delay:.2f}s: downstream {downstream.name} {verdict} ({state})",
            execution,
            layer="delivery",
            downstream=downstream.name,
            verdict=verdict,
        )
        self._defer(execution, request, args, kwargs, delay)

    def _leave_downstream(self, execution: Execution, *, failed: bool) -> None:
        import redis

        downstream = self.contract.downstream
        assert downstream is not None
        try:
            state = downstream_mod.leave(downstream, execution.task_id, failed=failed)
        except redis.RedisError:
            logger.warning(
                "downstream %s: could not free the slot (it expires with the lease)",
                downstream.name,
                extra={"task": self.name},
            )
            return
        metrics.breaker_open.labels(downstream.name).set(1 if state == "open" else 0)

    def _over_delivery_limit(
        self, execution: Execution, request: Any
    ) -> DeliveryLimitExceeded | None:
        """Count this delivery; the error to dead-letter with if it is one too many.

        Only redeliveries are counted (the broker flags them): a first delivery costs
        no round trip, and the count plus the first delivery is the total.
        """
        import redis

        if not _delivery(request, "redelivered"):
            return None
        try:
            redeliveries = delivery_limit.count_delivery(
                execution.task_id, int(request.retries or 0)
            )
        except redis.RedisError:
            # Counting is a safety net: without Redis the job still runs.
            logger.warning(
                "could not count a delivery",
                extra={"task": self.name, "job_id": execution.task_id},
            )
            return None
        deliveries, limit = redeliveries + 1, self.contract.max_deliveries
        if deliveries <= limit:
            return None
        return DeliveryLimitExceeded(self.name, deliveries=deliveries, limit=limit)

    def _claim_dedup(self, execution: Execution, request: Any) -> bool:
        """Delivery-side dedup: False (and recorded) when another message owns the id."""
        import redis

        dedup = self.contract.dedup
        assert dedup is not None
        if getattr(request, idempotency.REPLAY_HEADER, None) is not None:
            return True  # an operator's replay is deliberate
        dedup_id = execution.dedup_id
        try:
            owner = dedup_mod.claim(self.name, dedup_id, execution.task_id, window=dedup.window)
        except redis.RedisError as exc:
            # Cannot tell whether it is a duplicate: keep the message, try again later.
            self._audit(execution, "RETRY_SCHEDULED", exc=exc)
            raise self._retry(exc, _rng.uniform(1.0, 5.0)) from exc
        if owner == execution.task_id:
            return True
        metrics.dedup_dropped.labels(self.name, "delivery").inc()
        self._audit(
            execution, "DEDUPLICATED", note=f"dedup id {dedup_id!r} is owned by job {owner}"
        )
        return False

    def _begin(
        self,
        request: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        started: datetime | None = None,
    ) -> Execution:
        arguments, given = self.bind_arguments(tuple(args), dict(kwargs))
        key = idempotency.render_key(self.name, self.contract.idempotency_key, given)
        # The header is what the publisher rendered; the worker renders again from the
        # arguments it is about to run with, and that one is the key of record.
        request.idempotency_key = key
        execution = Execution(
            task_id=str(request.id or ""),
            key=key,
            fingerprint=idempotency.fingerprint(arguments),
            attempt=int(request.retries or 0) + 1,
            started_at=started or timezone.now(),
            audited=not request.called_directly,
            correlation_id=idempotency.correlation_of(request),
        )
        if self.contract.dedup is not None:
            execution.dedup_id = idempotency.render_key(
                self.name, self.contract.dedup.key, given, label="dedup key"
            )
        request.explicit = execution
        return execution

    def _handle_error(
        self,
        execution: Execution,
        request: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        exc: Exception,
    ) -> None:
        policy = self.contract.retry
        kind = policy.classify(exc)
        if policy.should_retry(exc):
            if execution.attempt < policy.max_attempts:
                delay = policy.delay(execution.attempt, exc, rng=_rng)
                metrics.retries_scheduled.labels(self.name, type(exc).__name__).inc()
                self._audit(execution, "RETRY_SCHEDULED", exc=exc, retry_delay=delay)
                # Celery's max_retries is off (None): max_attempts is the limit.
                raise self._retry(exc, delay)
            outcome, reason = "EXHAUSTED", "EXHAUSTED"
        elif kind is Classification.UNCLASSIFIED:
            outcome, reason = "FAILED_UNCLASSIFIED", "UNCLASSIFIED"
        else:
            outcome, reason = "FAILED_PERMANENT", "PERMANENT"
        self._dead_letter_and_audit(
            request,
            args,
            kwargs,
            exc,
            started=execution.started_at,
            key=execution.key,
            outcome_name=outcome,
            reason_name=reason,
            execution=execution,
        )

    # --- the handler's tools ------------------------------------------------------

    @contextmanager
    def effect(self, *, using: str | None = None) -> Iterator[Effect]:
        """The effect and its ledger row in one transaction; see ``django_outbox.ledger``."""
        from django_outbox import audit, ledger
        from django_outbox.conf import settings as audit_settings
        from django_outbox.models import Outcome

        execution = self._execution()
        alias = using or audit_settings.database
        # The attempt row joins the effect's commit only when that commit is the
        # effect's own and on the audit database; inside a caller's atomic() an outer
        # rollback could take it away, so it is then written when the attempt ends.
        joins_commit = (
            execution.audited
            and alias == audit_settings.database
            and not connections[alias].in_atomic_block
        )

        def attempt_row(claimed: Effect) -> list[ledger.Statement]:
            # Runs inside the effect's transaction, after the block: the attempt row
            # commits with the effect (one commit per job), and "applied" is never
            # recorded for an effect that rolled back.
            execution.outcome = Outcome.ALREADY_APPLIED if claimed.done else Outcome.APPLIED
            if not joins_commit:
                return []
            fields = self._attempt_fields(execution, execution.outcome)
            return [audit.insert_statement(fields, replace=execution.effect_row_written)]

        try:
            with ledger.effect(
                key=execution.key,
                fingerprint=execution.fingerprint,
                task_name=self.name,
                task_id=execution.task_id,
                using=using,
                before_commit=attempt_row,
                fence=execution.fence,
            ) as claimed:
                yield claimed
        except BaseException:
            execution.outcome = None  # rolled back: the error path records the attempt
            raise
        if joins_commit:
            execution.effect_row_written = execution.recorded = True
            assert execution.outcome is not None
            self._emit(execution, execution.outcome)
        if claimed.done:
            metrics.duplicates_absorbed.labels(self.name, "duplicate").inc()
            self._log("effect already applied: duplicate absorbed", execution, layer="effect")
        else:
            metrics.effects_applied.labels(self.name).inc()

    @property
    def fencing_token(self) -> int | None:
        """This execution's fencing token, for your own guarded writes
        (``django_outbox.fencing.fenced_update``); None without an execution lease."""
        return self._execution().fence

    def set_external_request_id(self, value: str) -> None:
        """Record the downstream's request id on this attempt (for its support desk)."""
        self._execution().external_request_id = str(value)

    def _execution(self) -> Execution:
        execution = getattr(self.request, "explicit", None)
        if not isinstance(execution, Execution):
            raise ExplicitError(
                f"Task {self.name}: effect() and set_external_request_id() "
                "work only while the task runs"
            )
        return execution

    # --- records ------------------------------------------------------------------

    def _attempt_fields(
        self,
        execution: Execution,
        outcome: Outcome,
        *,
        exc: BaseException | None = None,
        retry_delay: float | None = None,
        note: str = "",
    ) -> dict[str, Any]:
        from django_outbox import audit

        request = self.request
        return audit.attempt_fields(
            task_id=execution.task_id,
            task_name=self.name,
            idempotency_key=execution.key,
            attempt=execution.attempt,
            redelivered=bool(_delivery(request, "redelivered")),
            worker_host=str(request.hostname or ""),
            worker_pid=os.getpid(),
            started_at=execution.started_at,
            finished_at=timezone.now(),
            outcome=outcome,
            error_class=qualname(exc),
            error_message=str(exc)[:4000] if exc else note,
            retry_delay=retry_delay,
            correlation_id=execution.correlation_id,
            external_request_id=execution.external_request_id,
            replay_of=_int_or_none(getattr(request, idempotency.REPLAY_HEADER, None)),
        )

    def _audit(
        self,
        execution: Execution,
        outcome_name: str,
        *,
        exc: BaseException | None = None,
        retry_delay: float | None = None,
        note: str = "",
    ) -> None:
        """Record how the attempt ended, when no effect block recorded it already."""
        from django_outbox import audit
        from django_outbox.models import Outcome

        outcome = Outcome[outcome_name]
        fields = self._attempt_fields(
            execution, outcome, exc=exc, retry_delay=retry_delay, note=note
        )
        # An effect block may have committed this attempt's row before the handler
        # failed: update it rather than add a second row for one attempt.
        audit.record_attempt(fields, replace=execution.effect_row_written)
        execution.recorded = True
        self._emit(execution, outcome, exc=exc, retry_delay=retry_delay)

    def _emit(
        self,
        execution: Execution,
        outcome: Outcome,
        *,
        exc: BaseException | None = None,
        retry_delay: float | None = None,
    ) -> None:
        metrics.executions.labels(self.name, outcome.value).inc()
        elapsed = (timezone.now() - execution.started_at).total_seconds()
        metrics.attempt_seconds.labels(self.name).observe(elapsed)
        self._log(
            f"attempt {execution.attempt} ended: {outcome.value}",
            execution,
            layer="execution",
            outcome=outcome.value,
            retry_delay=retry_delay,
            error_class=qualname(exc) if exc else None,
        )

    def _dead_letter_and_audit(
        self,
        request: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        exc: BaseException,
        *,
        started: datetime,
        key: str,
        outcome_name: str,
        reason_name: str,
        execution: Execution | None = None,
    ) -> None:
        from django_outbox import dead_letters
        from django_outbox.models import DeadLetterReason

        attempt = execution.attempt if execution else int(request.retries or 0) + 1
        correlation = idempotency.correlation_of(request)
        reason = DeadLetterReason[reason_name]
        try:
            dead_letters.record(
                task_id=request.id,
                task_name=self.name,
                reason=reason,
                args=list(args),
                kwargs=kwargs,
                idempotency_key=key,
                error_class=qualname(exc),
                error_message=str(exc)[:4000],
                traceback="".join(tb.format_exception(exc)),
                attempts=attempt,
                correlation_id=correlation,
                queue=str(_delivery(request, "routing_key") or ""),
            )
        except DatabaseError as db_exc:
            # The dead letter is the only copy once the message is acked: keep the
            # message instead, and try again later.
            logger.exception(
                "could not record dead letter; retrying the message",
                extra={"task": self.name, "job_id": request.id, "idempotency_key": key},
            )
            raise self._retry(db_exc, _rng.uniform(1.0, 10.0)) from db_exc
        metrics.dead_letters.labels(self.name, reason.value).inc()
        if execution is None:
            execution = Execution(
                task_id=str(request.id or ""),
                key=key,
                fingerprint="",
                attempt=attempt,
                started_at=started,
                correlation_id=correlation,
            )
        self._audit(execution, outcome_name, exc=exc)

    def _log(self, message: str, execution: Execution, **fields: Any) -> None:
        logger.info(
            message,
            extra={
                "task": self.name,
                "job_id": execution.task_id,
                "idempotency_key": execution.key,
                "attempt": execution.attempt,
                "correlation_id": execution.correlation_id,
                "external_request_id": execution.external_request_id,
                **fields,
            },
        )


@contextmanager
def effect(*, using: str | None = None) -> Iterator[Effect]:
    """``self.effect()`` for handlers declared with ``@app.task`` without ``bind=True``."""
    task = current_task
    if not isinstance(task, ExplicitTask):  # current_task is a proxy; isinstance sees through
        raise ExplicitError("effect() works only inside a running ExplicitTask")
    with task.effect(using=using) as claimed:
        yield claimed


class ExplicitRequest(Request):
    """Worker main process: what happens to a message outside the handler.

    A hard time limit that killed the handler is recorded (``on_timeout``), and a body
    of the wrong shape is refused, not fatal:

    Celery unpacks a task body as ``[args, kwargs, embed]`` while building the request
    in the consumer; a body that decodes to anything else raises a ValueError there,
    which Celery 5.7 treats as an unrecoverable error and stops the whole worker (and
    the unacked message comes back to stop the next one). Raising InvalidTaskError
    instead makes Celery reject the one message; ``django_outbox.receivers`` records it
    as a dead letter with its raw body, and the worker goes on consuming.
    """

    def on_timeout(self, soft: bool, timeout: float) -> None:
        """The hard time limit killed the handler: it never reached its own records."""
        if not soft:
            from django_outbox import receivers

            receivers.record_hard_timeout(
                task_id=self.id,
                task_name=self.task_name,
                message=self.message,
                timeout=timeout,
                args=self.args,
                kwargs=self.kwargs,
            )
            self._pass_turn_of_killed_job()
        super().on_timeout(soft, timeout)

    def _pass_turn_of_killed_job(self) -> None:
        """The killed job ended for good (dead-lettered, acknowledged): the next job of
        its entity may run now, not after the ordering gap. The handler's own ``finally``
        never ran, so the main process passes the turn."""
        place = ordering_mod.place_in(self.request_dict)
        _pass_turn_on(place, task=self.task_name, job_id=self.id)

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        try:
            super().__init__(message, *args, **kwargs)
        except (ValueError, TypeError) as exc:
            headers = getattr(message, "headers", None) or {}
            raise InvalidTaskError(
                f"body of task {headers.get('task')!r} is not [args, kwargs, embed]: {exc}"
            ) from exc


def _pass_turn_on(place: tuple[str, int] | None, *, task: str, job_id: str | None) -> None:
    """Job number ``place`` of its entity ended for good: the next one's turn."""
    import redis

    if place is None:
        return
    try:
        ordering_mod.done(*place)
    except redis.RedisError:
        logger.warning(
            "ordering %s: could not pass the turn on (the next job waits out the gap)",
            place[0],
            extra={"task": task, "job_id": job_id},
        )


def _delivery(request: Any, name: str) -> Any:
    """A field of the broker's delivery info (routing key, redelivered flag)."""
    return (request.delivery_info or {}).get(name)


def _int_or_none(value: object) -> int | None:
    try:
        return int(value) if value is not None else None  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


__all__ = ["Execution", "ExplicitRequest", "ExplicitTask", "effect"]
# Outcome / DeadLetterReason are only names here (resolved lazily above), so the
# module imports without Django's app registry being ready.
_ = (DeadLetterReason, Outcome) if TYPE_CHECKING else None
