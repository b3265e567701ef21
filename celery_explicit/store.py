"""What the job path needs from the database, as one small interface.

The Celery side decides *what* to record; where it lives is the Django app's business.
``django_outbox`` registers its implementation when Django loads it
(``DjangoOutboxConfig.ready``), so ``celery_explicit`` never imports ``django_outbox``:
the dependency runs one way, and the import contracts in ``pyproject.toml`` hold it.

The facts written here are the evidence an operator reads afterwards: an attempt
(one execution of the handler), a dead letter, an effect with its ledger row, a fence
(an execution lease taken over), a message that never reached a task, and a slot a beat
published for a periodic entry (``celery_explicit.periodic``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from celery_explicit.errors import ExplicitError
from celery_explicit.outcomes import DeadLetterReason

#: One SQL statement and its parameters, run inside the effect's transaction.
Statement = tuple[str, Sequence[Any]]


@dataclass
class Effect:
    """What ``effect()`` yields: has this key's effect already committed?"""

    key: str
    fingerprint: str
    #: True when this key's effect already committed: do nothing, say so.
    done: bool
    #: A reference to the effect's result (a row id, a downstream id). Set it inside the
    #: block; it is stored with the ledger row and handed to every later duplicate.
    result_ref: str = ""


@dataclass(frozen=True)
class Rename:
    """A task's key template changed since a worker last recorded it."""

    task_name: str
    old: str
    new: str
    #: Jobs of this task with no final attempt yet (retries, deferrals due).
    in_flight: int


class Store(Protocol):
    def effect(
        self,
        *,
        key: str,
        fingerprint: str,
        task_name: str,
        task_id: str,
        using: str | None,
        before_commit: Callable[[Effect], list[Statement]] | None,
        fence: int | None,
        other_keys: Sequence[str] = (),
        accepted_fingerprints: Sequence[str] = (),
        cancellable: bool = False,
    ) -> AbstractContextManager[Effect]:
        """One transaction with the effect and its ledger row; refused when fenced, or
        (``cancellable``) when an operator cancelled the job (``JobCancelled``).

        ``other_keys``: the effect's other names (``celery_explicit.key_history``),
        checked in the same transaction and recorded with it. ``accepted_fingerprints``:
        stored fingerprints that are not a conflict besides ``fingerprint``."""

    def earlier_key_templates(self, task_name: str, current: str) -> list[str]:
        """The task's recorded key templates other than ``current``, most recent first."""

    def record_key_templates(self, current: Mapping[str, str]) -> list[Rename]:
        """Record each task's current template; the renames since the last record."""

    def attempt_statement(self, fields: Mapping[str, Any], *, replace: bool) -> Statement:
        """The attempt row as a statement, to commit with the effect."""

    def record_attempt(self, fields: Mapping[str, Any], *, replace: bool) -> None:
        """The attempt row on its own; a failure is logged, never raised."""

    def record_dead_letter(
        self,
        *,
        task_id: str | None,
        task_name: str,
        reason: DeadLetterReason,
        args: Any,
        kwargs: Any,
        idempotency_key: str,
        error_class: str,
        error_message: str,
        traceback: str,
        attempts: int,
        correlation_id: str,
        queue: str,
        exchange: str,
    ) -> None:
        """Keep the message as evidence (``queue`` is the routing key it came with);
        raises a database error if it could not."""

    def record_takeover(
        self,
        task_id: str,
        key: str,
        fence: int,
        previous: str,
        *,
        cause: str = "",
        holder_started_ms: int | None = None,
    ) -> None:
        """Announce fence ``fence`` of job ``task_id``: an older holder's commit is refused.
        ``previous`` (host:pid) took its lease at ``holder_started_ms`` and lost it by
        ``cause`` (``execution_lease.TakeoverCause``)."""

    def record_fence(self, task_id: str, key: str, fence: int) -> None:
        """Announce fence ``fence`` of job ``task_id`` naming no execution taken over:
        a redelivered job found its lease free, and an earlier execution whose lease
        record was lost (a failover) must not commit."""

    def newer_fence(self, task_id: str, fence: int) -> int | None:
        """The fence row's token of job ``task_id`` if newer than ``fence``, else None:
        has another execution taken the job over, whatever Redis still holds?"""

    def record_hard_timeout(
        self,
        *,
        task_id: str | None,
        task_name: str,
        message: Any,
        timeout: float,
        args: Any,
        kwargs: Any,
    ) -> None:
        """Worker main process: the hard time limit killed a handler."""

    def record_undecodable(
        self, *, task_id: str | None, task_name: str, message: Any, error: BaseException
    ) -> None:
        """Worker main process: a message whose body does not decode."""

    def record_slot(
        self,
        *,
        entry: str,
        slot: datetime,
        task_name: str,
        task_id: str,
        idempotency_key: str,
        published_by: str,
        grid: str,
    ) -> None:
        """Beat: the schedule slot ``slot`` of periodic entry ``entry`` was published as
        job ``task_id`` (``celery_explicit.periodic``); a failure is logged, never raised."""


_store: Store | None = None


def register(store: Store) -> None:
    """Install the store (``django_outbox`` does, when Django loads it)."""
    global _store
    _store = store


def get() -> Store:
    if _store is None:
        raise ExplicitError(
            "celery_explicit has no store to record into: add 'django_outbox' to "
            "INSTALLED_APPS (and run django.setup() before the worker imports tasks)"
        )
    return _store
