"""The job path: one delivered message, through the declared steps, to the handler.

The steps run in this fixed order, each only where the task declares its mechanism
(``celery_explicit.steps`` says what a step may answer):

0. ``database``: while this process has seen the database unavailable, a job is
   deferred unless it answers again (``database_outage``; every task, free otherwise);
1. ``delivery_limit``: a message delivered too many times is dead-lettered, not run;
2. ``dedup``: a message whose dedup id another message owns is dropped;
3. ``ordering``: a job whose entity has an earlier job still to end is deferred;
4. ``execution_lease``: a job another execution is running is deferred; a stale
   holder's lease is taken over and fenced;
5. ``rate_limit``: a job whose key has had its starts for the period is deferred to
   the start reserved for it;
6. ``downstream``: a job whose downstream is full or broken is deferred.

Then the handler runs, and one attempt row records how it ended (``records``); an
error goes to ``failures``, which classifies it (``retry_policy``) and retries,
dead-letters, or defers the job while the database is down. Whatever happened, every
declared step is then told how the delivery ended, in reverse order (``end``). This
module is the only one that acts on a step's decision: it re-publishes
(``republish``), records, and dead-letters (``failures``).

Each step's ``after_run`` is called in its own ``try``, the way Dramatiq's broker
calls each middleware's hook: an error in one (a bug, a reply it did not expect) is
logged once, with the step's name and the job's id, and the steps before it in the
path still give back what they took, the execution lease above all. Such an error
does not change the job's outcome: by then the attempt is recorded, and a retry or a
deferral published, so the job ends as it ended. What the failed step did not give
back runs out by itself: a downstream slot and an entity's turn with the lease, a
delivery count after its TTL.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded
from django.utils import timezone

from celery_explicit import (
    correlation,
    database_outage,
    failures,
    job_log,
    key_history,
    keys,
    metrics,
    records,
    republish,
    sensitive,
    tracing,
)
from celery_explicit.cancellation import CancellationStep
from celery_explicit.contract import Contract
from celery_explicit.dedup import DedupStep
from celery_explicit.delivery_limit import DeliveryLimitStep
from celery_explicit.downstream import DownstreamStep
from celery_explicit.errors import BadInput, IdempotencyConflict, JobCancelled, LeaseLost
from celery_explicit.execution import Execution, running
from celery_explicit.execution_lease_step import ExecutionLeaseStep
from celery_explicit.headers import SENT_AT_HEADER, correlation_of
from celery_explicit.ordering_step import OrderingStep
from celery_explicit.outcomes import Outcome
from celery_explicit.rate_limit import RateLimitStep
from celery_explicit.retry_policy import Classification
from celery_explicit.steps import (
    RUN,
    DeadLetter,
    Decision,
    Defer,
    Drop,
    Ending,
    Job,
    RetryLater,
    Step,
)

logger = job_log.get_logger("celery_explicit")


#: Every kind of step, in the order they run (the module docstring says why).
STEPS: tuple[type[Step], ...] = (
    database_outage.DatabaseStep,
    DeliveryLimitStep,
    DedupStep,
    CancellationStep,
    OrderingStep,
    ExecutionLeaseStep,
    RateLimitStep,
    DownstreamStep,
)


def build_steps(contract: Contract) -> tuple[Step, ...]:
    """The declared steps of one task, in the order they run."""
    return tuple(step for kind in STEPS if (step := kind.declared(contract)) is not None)


@dataclass
class _Delivery:
    entered: set[str]
    transient_failure: bool = False


def deliver(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``task.__call__`` for a message from the broker."""
    request = task.request
    state = _Delivery(entered=set())
    goes_on = False
    # While it runs, this job's correlation id is the current one (every job its
    # handler publishes carries it) and its facts start every log line we write.
    correlation_token = correlation.bind(correlation_of(request))
    log_token = job_log.bind({"task": task.name, "job_id": str(request.id or "")})
    try:
        with tracing.attempt(task, request):
            return _through_steps(task, request, args, kwargs, state)
    except (Retry, Ignore):
        # A retry is scheduled, or the job was deferred: it is not over yet. (Ignore
        # is also how a handler drops its own message; an ordered entity then waits
        # out its gap.)
        goes_on = True
        raise
    except Reject as reject:
        goes_on = bool(getattr(reject, "requeue", False))
        raise
    finally:
        ending = Ending(goes_on=goes_on, transient_failure=state.transient_failure)
        try:
            end(task.name, task.job_steps, request, running(request), ending, state.entered)
        finally:
            job_log.reset(log_token)
            correlation.reset(correlation_token)


def end(
    task_name: str,
    steps: Sequence[Step],
    request: Any,
    execution: Execution | None,
    ending: Ending,
    entered: Collection[str],
) -> None:
    """Tell each step how the delivery ended, the last first, each in its own ``try``:
    one step's error is logged and never keeps another from giving back what it took."""
    for step in reversed(steps):
        try:
            step.after_run(request, execution, ending, entered=step.name in entered)
        except Exception:
            logger.exception(
                "%s: could not end its part of the job; the other steps still end theirs",
                step.name,
                extra={"task": task_name, "job_id": str(request.id or ""), "step": step.name},
            )


def begin(
    task: Any, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, started: Any = None
) -> Execution:
    """Bind the arguments and render the key of record; ``BadInput`` if they do not fit."""
    contract: Contract = task.contract
    arguments, given = task.bind_arguments(tuple(args), dict(kwargs))
    key = keys.render_key(task.name, contract.idempotency_key, given)
    # The header is what the publisher rendered; the worker renders again from the
    # arguments it is about to run with, and that one is the key of record. Where they
    # differ (a renamed template), both are the effect's names (``key_history``).
    published: str | None = None
    others: tuple[str, ...] = ()
    if not request.called_directly:
        published = key_history.published_key(task.name, request)
        others = key_history.other_keys(task.name, contract.idempotency_key, key, published, given)
    request.idempotency_key = key
    kept = keys.identity_arguments(arguments, contract.signature)
    # Rows written before defaults were left out carry every argument's fingerprint:
    # the same call, different only where a default was left out.
    legacy = keys.fingerprint(arguments) if len(kept) != len(arguments) else None
    execution = Execution(
        task_id=str(request.id or ""),
        task_name=task.name,
        key=key,
        published_key=published if published is not None and published != key else "",
        other_keys=others,
        accepted_fingerprints=(legacy,) if legacy else (),
        fingerprint=keys.fingerprint(kept),
        attempt=int(request.retries or 0) + 1,
        started_at=started or timezone.now(),
        audited=not request.called_directly,
        correlation_id=correlation_of(request),
    )
    if contract.dedup is not None:
        execution.dedup_id = keys.render_key(
            task.name, contract.dedup.key, given, label="dedup key"
        )
    if contract.rate_limit is not None:
        execution.rate_key = keys.render_key(
            task.name, contract.rate_limit.key, given, label="rate limit key"
        )
    if contract.sensitive:
        execution.sensitive = contract.sensitive
        execution.secrets = sensitive.values_of(
            contract.sensitive, contract.signature, args, kwargs
        )
    waited = _queue_wait(request, execution.started_at)
    if waited is not None:
        execution.timings["queue_wait"] = waited * 1000.0
        metrics.queue_wait_seconds.labels(task.name).observe(waited)
    request.explicit = execution
    job_log.update(**execution.log_fields())
    return execution


def _queue_wait(request: Any, started: datetime) -> float | None:
    """Seconds the message waited to be run: from its publish (``explicit_sent_at``),
    or from its ETA when it had one (a retry's backoff is not waiting in the queue)."""
    sent_at = getattr(request, SENT_AT_HEADER, None)
    if not isinstance(sent_at, int | float):
        return None
    eta = request.eta
    if eta:
        with contextlib.suppress(TypeError, ValueError):
            eta_at = eta if isinstance(eta, datetime) else datetime.fromisoformat(str(eta))
            sent_at = max(sent_at, eta_at.timestamp())
    return max(0.0, started.timestamp() - sent_at)


def _through_steps(
    task: Any, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any], state: _Delivery
) -> Any:
    started = timezone.now()
    try:
        execution = begin(task, request, args, kwargs, started=started)
    except BadInput as exc:
        stand_in = Execution(
            task_id=str(request.id or ""),
            task_name=task.name,
            key="",
            fingerprint="",
            attempt=int(request.retries or 0) + 1,
            started_at=started,
            correlation_id=correlation_of(request),
        )
        failures.dead_letter(task, args, kwargs, exc, stand_in, "BAD_INPUT")
        raise
    job = Job(task_name=task.name, request=request, execution=execution)
    for step in task.job_steps:
        step_started = time.perf_counter()
        decision = step.before_run(job)
        execution.timings[step.name] = (time.perf_counter() - step_started) * 1000.0
        if decision is RUN:
            state.entered.add(step.name)
            continue
        return _act(task, job, args, kwargs, decision, step.name)
    return _run_handler(task, job, args, kwargs, state)


def _act(
    task: Any,
    job: Job,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    decision: Decision,
    by: str,
) -> None:
    """Carry out a step's decision not to run the handler now."""
    execution = job.execution
    if isinstance(decision, Defer):
        records.log(
            f"deferred {decision.seconds:.2f}s: {decision.reason}",
            execution,
            layer="delivery",
            **decision.log_fields,
        )
        republish.defer(task, execution, args, kwargs, decision.seconds, by=by)
    if isinstance(decision, Drop):
        records.attempt(execution, job.request, decision.outcome, note=decision.note)
        return None
    if isinstance(decision, DeadLetter):
        failures.dead_letter(task, args, kwargs, decision.error, execution, decision.name)
        raise decision.error
    assert isinstance(decision, RetryLater), decision
    cause = failures.outage_cause(decision.error)
    if cause is not None:
        # The step's store write failed for the database: wait for it, attempts kept.
        failures.wait_for_database(task, execution, job.request, args, kwargs, cause)
    if decision.record:
        records.attempt(execution, job.request, Outcome.RETRY_SCHEDULED, exc=decision.error)
    raise republish.retry(task, decision.error, decision.delay) from decision.error


def _run_handler(
    task: Any, job: Job, args: tuple[Any, ...], kwargs: dict[str, Any], state: _Delivery
) -> Any:
    execution, request = job.execution, job.request
    handler_started = time.perf_counter()
    try:
        try:
            result = task.run_handler(*args, **kwargs)
        finally:
            execution.timings["handler"] = (time.perf_counter() - handler_started) * 1000.0
    except Retry:
        # The handler called self.retry() itself: an explicit decision, recorded.
        records.attempt(execution, request, Outcome.RETRY_SCHEDULED)
        raise
    except SoftTimeLimitExceeded as exc:
        failures.dead_letter(task, args, kwargs, exc, execution, "MAX_RUN_TIME")
        raise
    except IdempotencyConflict as exc:
        metrics.idempotency_conflicts.labels(task.name, "arguments").inc()
        failures.dead_letter(task, args, kwargs, exc, execution, "CONFLICT")
        raise
    except LeaseLost as exc:
        # This execution lost its lease while paused and a newer one runs the job
        # now: nothing of this attempt committed, and the message is the newer
        # one's to finish. Recorded, not retried, not dead-lettered.
        metrics.fenced_commits.labels(task.name).inc()
        execution.lost_lease = True
        records.attempt(execution, request, Outcome.FENCED, exc=exc)
        return None
    except JobCancelled as exc:
        # An operator cancelled the job: its effect's commit was refused. Recorded,
        # acknowledged, not retried, not dead-lettered.
        metrics.cancelled.labels(task.name, "at_commit").inc()
        records.attempt(execution, request, Outcome.CANCELLED, exc=exc)
        return None
    except Exception as exc:
        cause = failures.outage_cause(exc)
        if cause is not None:
            failures.defer_for_outage(task, job, args, kwargs, exc, cause)
        state.transient_failure = failures.classify(task, exc) is Classification.RETRY
        failures.handler_failed(task, job, args, kwargs, exc)
        raise
    if not execution.recorded:
        records.attempt(execution, request, execution.outcome or Outcome.SUCCEEDED)
    elif execution.line_pending and execution.outcome is not None:
        records.emit(execution, execution.outcome)
    return result
