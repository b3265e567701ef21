"""Exceptions of celery_explicit, grouped by what the caller should do about them.

``ExplicitError`` is the root. Do not raise it directly: raise the subclass that says
what happened, so that an operator reading a dead letter knows which of the three
layers (delivery, execution, effect) went wrong.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured


class ExplicitError(Exception):
    """Root of every exception raised by celery_explicit. Do not raise directly."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Our errors take keyword-only arguments, which the default pickling (``cls(*args)``)
        # cannot pass: Celery would then log and store the nearest class that pickles
        # (``ExplicitError(...)`` for an ``IdempotencyConflict``). Rebuilt from the
        # instance's own state, every subclass keeps its name and attributes.
        return (_restore, (type(self), self.args, self.__dict__))


def _restore(cls: type[ExplicitError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


# --- configuration: fix the code or the settings, nothing to retry -----------------


class ContractError(ExplicitError, ImproperlyConfigured):
    """A task's declared contract is missing a field or contradicts itself.

    Raised when the task class is created (or, for decorator-declared tasks, when the
    Celery app is finalized) and by ``manage.py check``.
    """

    def __init__(
        self, task_name: str, message: str, *, field: str | None = None, hint: str = ""
    ) -> None:
        self.task_name = task_name
        self.field = field
        #: What to write instead, where the error can say (``manage.py check`` shows it).
        self.hint = hint
        super().__init__(f"Task {task_name}: {message}")


# --- permanent for this message: dead-letter it, never retry ------------------------


class BadInput(ExplicitError):
    """A delivered message cannot be executed as sent (arguments, key fields, body).

    The message goes to the dead letters on its first delivery and is never retried.
    """

    def __init__(self, task_name: str, message: str) -> None:
        self.task_name = task_name
        super().__init__(f"Task {task_name}: {message}")


class DeliveryLimitExceeded(ExplicitError):
    """The same message was delivered more than ``max_deliveries`` times (its handler
    keeps killing its worker, or keeps being redelivered): dead-lettered, not run."""

    def __init__(self, task_name: str, *, deliveries: int, limit: int) -> None:
        self.task_name = task_name
        self.deliveries = deliveries
        self.limit = limit
        super().__init__(
            f"Task {task_name}: delivered {deliveries} times, more than max_deliveries="
            f"{limit}; dead-lettered instead of running again"
        )


class IdempotencyConflict(ExplicitError):
    """An effect with this idempotency key was already applied with other arguments.

    Neither applied again nor silently dropped: the message goes to the dead letters
    with reason ``conflict`` so an operator decides.
    """

    def __init__(self, key: str, *, stored_fingerprint: str, fingerprint: str) -> None:
        self.key = key
        self.stored_fingerprint = stored_fingerprint
        self.fingerprint = fingerprint
        super().__init__(
            f"Idempotency key {key!r} was already applied with different arguments "
            f"(stored fingerprint {stored_fingerprint[:12]}, this message {fingerprint[:12]})"
        )


# --- retryable: a handler may raise this to ask for a retry at a given time ----------


class RetryAfter(ExplicitError):
    """Raised by a handler (or subclassed by a downstream error) to retry after a delay.

    Any exception with a numeric ``retry_after`` attribute (seconds) gets the same
    treatment when its class is in the task's ``retry_on``; this class is retryable by
    itself, whatever the task declares, because raising it is an explicit decision.
    """

    def __init__(self, retry_after: float, message: str = "") -> None:
        self.retry_after = float(retry_after)
        super().__init__(message or f"retry requested after {self.retry_after:g}s")


# --- locks -----------------------------------------------------------------------------


class LockError(ExplicitError):
    """A lease lock could not be taken, kept or given back. Carries ``lock_name``."""

    def __init__(self, lock_name: str, message: str) -> None:
        self.lock_name = lock_name
        super().__init__(message)


class LockConfigError(LockError, ValueError):
    """A lock declared with a bad TTL or name: fix the code."""


class LockNotAcquired(LockError):
    """Still held by another owner after the bounded wait."""

    def __init__(self, lock_name: str, *, waited: float) -> None:
        self.waited = waited
        super().__init__(
            lock_name,
            f"Cannot acquire lock {lock_name}: held by another owner (waited {waited:.3f}s)",
        )


class LockNotReplicated(LockError):
    """Acquired, but fewer replicas than asked held the fencing token in time: the lock
    was released again, since a failover could hand the same lock to someone else."""

    def __init__(self, lock_name: str, *, replicas: int, acknowledged: int) -> None:
        self.replicas = replicas
        self.acknowledged = acknowledged
        super().__init__(
            lock_name,
            f"Cannot acquire lock {lock_name}: {acknowledged} of the {replicas} replicas "
            "asked for (replicas=) held its fencing token in time; the lock was released",
        )


class LockNotOwned(LockError):
    """Release or extend by a token that no longer owns the lock (expired or stolen)."""

    def __init__(self, lock_name: str, *, action: str, token: str | None) -> None:
        self.action = action
        self.token = token
        detail = (
            "no longer owned by this token"
            if token
            else "this holder never acquired it or already released it"
        )
        super().__init__(lock_name, f"Cannot {action} lock {lock_name}: {detail}")


class StaleFencingToken(ExplicitError):
    """A write carried a fencing token older than the one already stored: refused."""

    def __init__(
        self,
        target: str,
        *,
        token: int,
        current: int,
        why: str = "a newer holder already wrote",
    ) -> None:
        self.target = target
        self.token = token
        self.current = current
        super().__init__(
            f"Refused write to {target}: fencing token {token} is older than "
            f"the stored {current} ({why})"
        )


class LeaseLost(StaleFencingToken):
    """This execution's effect was refused: a newer execution of the same job took its
    execution lease over while it was paused. Recorded as ``fenced``; the newer one
    finishes the job. (A ``StaleFencingToken`` from your own ``fenced_update`` is an
    ordinary error of the handler, classified like any other.)"""


class JobCancelled(ExplicitError):
    """An operator cancelled this job (``manage.py explicit_cancel``, the admin): its
    effect's commit was refused. Recorded as ``cancelled``; not retried, not
    dead-lettered."""

    def __init__(self, task_id: str, key: str, *, by: str) -> None:
        self.task_id = task_id
        self.key = key
        self.by = by
        super().__init__(f"job {task_id} (key {key}) was cancelled by {by}: effect refused")


class StaleVersion(ExplicitError):
    """A write carried a version older than the one already stored: refused."""

    def __init__(self, target: str, *, version: int, current: int) -> None:
        self.target = target
        self.version = version
        self.current = current
        super().__init__(
            f"Refused write to {target}: version {version} is older than the "
            f"stored {current} (a later event was already applied)"
        )


def qualname(exc: BaseException | None) -> str:
    """``module.Class`` of an error, as attempt rows and dead letters store it."""
    if exc is None:
        return ""
    klass = type(exc)
    return f"{klass.__module__}.{klass.__qualname__}"
