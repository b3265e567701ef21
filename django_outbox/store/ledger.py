"""The ledger: a business effect happens once per idempotency key.

``effect()`` opens one database transaction and claims the key in it by inserting the
ledger entry *first*. A second execution with the same key (a redelivery, a retry, a
concurrent worker) blocks on the primary key until the first transaction ends, then
sees the committed row and is told ``done``. If the first rolls back, its row vanishes
with its effect and the second one applies. The database's constraint decides; no
Redis check beforehand could (it would race with the commit).

Usage, inside a task (``ExplicitTask.effect()`` fills in the key)::

    with self.effect() as effect:
        if effect.done:
            return effect.result_ref
        Payment.objects.filter(id=payment_id).update(status="captured")
        effect.result_ref = str(payment_id)
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from celery_explicit import app_version
from celery_explicit.errors import IdempotencyConflict, JobCancelled, LeaseLost
from celery_explicit.store import Effect, Statement
from django_outbox.conf import settings
from django_outbox.db import ledger_sql, libpq


@contextmanager
def effect(
    *,
    key: str,
    fingerprint: str,
    task_name: str,
    task_id: str,
    using: str | None = None,
    before_commit: Callable[[Effect], list[Statement]] | None = None,
    fence: int | None = None,
    other_keys: Sequence[str] = (),
    accepted_fingerprints: Sequence[str] = (),
    cancellable: bool = False,
) -> Iterator[Effect]:
    """One transaction holding the effect and its ledger entry.

    ``before_commit`` returns statements to run in the same transaction after the
    block (the attempt row). Raises ``IdempotencyConflict`` when the key was applied
    with other arguments: that is neither a duplicate to absorb nor a new effect.
    ``fence`` is the execution lease's token for job ``task_id``: the commit is
    refused (``StaleFencingToken``, nothing written) when a newer execution took the
    lease over. ``other_keys`` are the effect's other names (a renamed key template,
    ``celery_explicit.key_history``): found under one, the effect is done; applied,
    it is recorded under each of them too, in the same commit. ``cancellable``: the
    commit is refused (``JobCancelled``) when an operator cancelled the job
    (``celery_explicit.cancellation``).
    """
    alias = using or settings.database
    accepted = (fingerprint, *accepted_fingerprints)
    connection = connections[alias]
    owns_transaction = not connection.in_atomic_block
    with transaction.atomic(using=alias):
        trips = _round_trips(connection) if owns_transaction else None
        params: list[Any] = [
            key, task_name, task_id, fingerprint, timezone.now(), app_version.current()
        ]  # fmt: skip
        if trips is not None:
            won, stored = trips.begin_claim_and_read(params)
            if not won and stored is None:
                stored = _stored_or_claim(connection, params)
        else:
            won = _claim(connection, params)
            stored = None if won else _stored_or_claim(connection, params)
        found_elsewhere = False
        if stored is None and other_keys:
            # Claimed under the key of record: under another of its names it may have
            # been applied already (one more read, only for a job that has one).
            stored = _stored_under(connection, other_keys)
            found_elsewhere = stored is not None
        if stored is None:
            claimed = Effect(key=key, fingerprint=fingerprint, done=False)
        else:
            stored_fingerprint, result_ref = stored
            if stored_fingerprint not in accepted:
                raise IdempotencyConflict(
                    key, stored_fingerprint=stored_fingerprint, fingerprint=fingerprint
                )
            claimed = Effect(key=key, fingerprint=fingerprint, done=True, result_ref=result_ref)

        yield claimed

        if connection.needs_rollback:
            # Something inside the block failed and was caught (Django marked the
            # transaction for rollback): the effect is not whole, so it must not
            # commit, and the caller must not believe it did.
            raise TransactionManagementError(
                f"effect {key!r} rolled back: a database error inside the effect block "
                "was caught; let it propagate or wrap the failing part in atomic()"
            )
        statements: list[Statement] = []
        ref = str(claimed.result_ref)[:255] if claimed.result_ref else ""
        if ref and (not claimed.done or found_elsewhere):
            # Applied now, or under another name: the key of record's row (claimed by
            # this transaction) carries the result a later duplicate is handed.
            statements.append((ledger_sql.RESULT, [ref, key]))
        for other in other_keys:
            # Under every name, so a worker that knows only one of them finds it.
            statements.append((ledger_sql.CLAIM, [other, *params[1:]]))
            if ref and not claimed.done:
                statements.append((ledger_sql.RESULT, [ref, other]))
        if before_commit is not None:
            statements += before_commit(claimed)
        # A cancellable job's commit is refused once an operator cancelled it
        # (celery_explicit.cancellation); the lock orders it with the cancel.
        cancel_check = cancellable and not claimed.done
        if cancel_check and connection.vendor == "postgresql":
            statements.append((ledger_sql.CANCEL_LOCK, [task_id, key]))
        if trips is not None:
            if cancel_check:
                statements.append((ledger_sql.CANCELLED_CHECK, [task_id, key]))
            if fence is not None:
                statements.append((ledger_sql.FENCE_CHECK, [task_id, fence]))
            # Committed here; Django's own commit at the end of atomic() then finds the
            # transaction closed and has nothing to do (its on_commit hooks still run).
            try:
                trips.execute_and_commit(statements)
            except DatabaseError as exc:
                # The markers are ours; the server's wording around them may be localized.
                cancelled = re.search(
                    rf"{ledger_sql.CANCELLED_MARKER} (.*?) {ledger_sql.CANCELLED_END}", str(exc)
                )
                if cancelled is not None:
                    raise JobCancelled(task_id, key, by=cancelled.group(1)) from None
                found = re.search(rf"{ledger_sql.STALE_MARKER} (\d+)", str(exc))
                if found is None:
                    raise
                raise _stale(task_id, key, fence, int(found.group(1))) from None
        else:
            with connection.cursor() as cursor:
                for sql, statement_params in statements:
                    cursor.execute(sql, statement_params)
                if cancel_check:
                    cursor.execute(ledger_sql.CANCELLED, [task_id, key])
                    by = cursor.fetchone()
                    if by is not None:
                        raise JobCancelled(task_id, key, by=str(by[0]))
                if fence is not None:
                    cursor.execute(ledger_sql.FENCE, [task_id, fence])
                    newer_row = cursor.fetchone()
                    if newer_row is not None:
                        raise _stale(task_id, key, fence, int(newer_row[0]))


def _claim(connection: Any, params: list[Any]) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(ledger_sql.CLAIM, params)
        return cursor.fetchone() is not None


def _stored_or_claim(connection: Any, params: list[Any]) -> Sequence[Any] | None:
    """After a lost claim: the stored ``(fingerprint, result_ref)`` of the key, or None
    when the row was deleted before the read (a prune of old ledger entries) and this
    transaction has claimed the key after all."""
    key = params[0]
    for _ in range(3):
        with connection.cursor() as cursor:
            cursor.execute(ledger_sql.EXISTING, [key])
            stored = cursor.fetchone()
        if stored is not None:
            return stored  # type: ignore[no-any-return]
        if _claim(connection, params):
            return None
    raise DatabaseError(f"effect {key!r}: the ledger entry kept vanishing")


def _stored_under(connection: Any, keys: Sequence[str]) -> Sequence[Any] | None:
    """The stored ``(fingerprint, result_ref)`` under one of ``keys``, or None: one
    statement whatever their number."""
    marks = ", ".join(["%s"] * len(keys))
    with connection.cursor() as cursor:
        cursor.execute(ledger_sql.EXISTING_UNDER_ANY.format(placeholders=marks), list(keys))
        return cursor.fetchone()  # type: ignore[no-any-return]


def _stale(task_id: str, key: str, fence: int | None, newer: int) -> LeaseLost:
    return LeaseLost(
        f"effect {key!r} of job {task_id}",
        token=fence or 0,
        current=newer,
        why="a newer execution of this job took its lease over",
    )


class _RoundTrips:
    """PostgreSQL only: BEGIN + claim in one round trip, the last writes + COMMIT in one
    (``django_outbox.db.libpq``).

    A plain ``atomic()`` costs three round trips (BEGIN, the update, COMMIT); the ledger
    would add two more statements. Sending each with its neighbour keeps the job at
    three, which is what makes the ledger cheap next to a bare transaction
    (docs/performance.md). The parameters are bound here as literals (``_quote``).
    ``EXPLICIT_LEDGER_ROUND_TRIPS = False`` turns this off; libpq's blocking call would
    stall a gevent/eventlet hub: turn it off with green pools.
    """

    def __init__(self, trips: libpq.RoundTrips) -> None:
        self._trips = trips
        self._raw = trips.raw
        self._escape = trips.literal_escaper()

    def _mogrify(self, sql: str, params: Sequence[Any]) -> str:
        """psycopg's client-side binding: for the values ``_literals`` leaves to it (a
        cursor made on demand: most jobs never need one)."""
        import psycopg

        return str(psycopg.ClientCursor(self._raw).mogrify(sql, params))

    def begin_claim_and_read(self, params: Sequence[Any]) -> tuple[bool, Sequence[Any] | None]:
        """BEGIN, the claim and the read of the stored row, in one round trip: whether
        the claim won, and when it lost, the stored ``(fingerprint, result_ref)``.

        The read is its own statement after the claim, so it takes a new snapshot and
        sees the row of a concurrent claimant the claim waited for. A duplicate then
        costs two round trips, not three; a first run pays for a primary-key read it
        does not need (bench/effect_cost.py, P2a and P2c). None when the claim lost and
        the row is gone already (pruned): the caller reads and claims again.
        """
        results = self._trips.run_all(
            f"BEGIN; {self._quote(ledger_sql.CLAIM, params)}; "
            f"{self._quote(ledger_sql.EXISTING, params[:1])}"
        )
        if results[1].ntuples:
            return True, None
        read = results[2]
        if not read.ntuples:
            return False, None
        encoding = self._raw.info.encoding
        return False, tuple(read.get_value(0, column).decode(encoding) for column in (0, 1))

    def execute_and_commit(self, statements: list[Statement]) -> None:
        parts = [self._quote(sql, params) for sql, params in statements]
        self._trips.commit_with(parts, what="the effect's transaction")

    def _quote(self, sql: str, params: Sequence[Any]) -> str:
        """``sql`` with its ``%s`` placeholders replaced by ``params`` as literals.

        The values a claim and an attempt row carry (text, integers, finite floats,
        booleans, None, aware datetimes) are written here: text through libpq's own
        ``PQescapeLiteral`` (the server's encoding and ``standard_conforming_strings``
        respected), the rest as their SQL spelling. psycopg's ``mogrify`` did the
        same at about 40 µs a statement, a tenth of a job's CPU in our code (py-spy,
        bench/cpu_per_job.py); it still writes any other value, and text holding a NUL
        byte (libpq's escape would stop at it; psycopg refuses it, as it should).
        """
        literals = _literals(params, self._escape)
        if literals is None:
            return self._mogrify(sql, params)
        # Our statements hold no '%' but their placeholders ('%%' would stay '%').
        return sql % literals


#: Text written between single quotes as it is.
_PLAIN = re.compile(r"[A-Za-z0-9 _.:@/+=,;()\[\]{}<>|#*!?~^&$-]*").fullmatch


def _literals(values: Sequence[Any], escape: Callable[[bytes], bytes]) -> tuple[str, ...] | None:
    """Each of ``values`` as a SQL literal; None when one of them is left to psycopg.

    One loop, no function call per value: a job quotes about 26 (the claim, the
    attempt row, the fence check). An attempt row's 20 took 16.6 µs with a call each,
    10.9 µs in one loop (best of seven timings).
    """
    written: list[str] = []
    append = written.append
    for value in values:
        kind = type(value)
        if kind is str:
            if _PLAIN(value):
                # Nothing in it a literal must escape (no quote, no backslash, nothing
                # outside printable ASCII): most keys, task names and ids.
                append(f"'{value}'")
            elif "\x00" in value:
                return None
            else:
                append(escape(value.encode()).decode())
        elif value is None:
            append("NULL")
        elif kind is bool:
            append("true" if value else "false")
        elif kind is int:
            append(str(value))
        elif kind is float and math.isfinite(value):
            append(repr(value))
        elif kind is dt.datetime and value.tzinfo is not None:
            append(f"'{value.isoformat()}'::timestamptz")
        else:
            return None
    return tuple(written)


def _round_trips(connection: Any) -> _RoundTrips | None:
    """The fast path, when this transaction is ours and has not started on the server."""
    trips = libpq.for_new_transaction(connection, settings.ledger_round_trips)
    return None if trips is None else _RoundTrips(trips)


def record_takeover(
    task_id: str,
    key: str,
    fence: int,
    previous: str,
    *,
    cause: str = "",
    holder_started_ms: int | None = None,
) -> None:
    """Announce the newer fence of job ``task_id``, before its new execution runs.

    Autocommit and upsert-to-the-larger: a stale holder's ``effect()`` reads this row
    in its commit (``ledger_sql.FENCE``). Written only on a takeover, so the common
    path never pays for it. The row also keeps the execution taken over (its start and
    why it lost its lease): ``explain`` tells an execution that died from it alone.
    """
    connection = connections[settings.database]
    started = (
        dt.datetime.fromtimestamp(holder_started_ms / 1000.0, dt.UTC)
        if holder_started_ms is not None
        else None
    )
    params: list[Any] = [task_id, fence, key[:255], previous[:255], timezone.now()]
    params += [started, cause[:16]]
    with connection.cursor() as cursor:
        cursor.execute(ledger_sql.TAKEOVER, params)


def record_fence(task_id: str, key: str, fence: int) -> None:
    """Announce fence ``fence`` of job ``task_id`` with no execution known to hold an
    older one: a redelivered job found its lease free (``ledger_sql.RAISE_FENCE``).

    An earlier execution may still run with its record lost (a Redis failover that
    dropped the lease's keys): its commit is refused as a takeover's would be.
    """
    with connections[settings.database].cursor() as cursor:
        cursor.execute(ledger_sql.RAISE_FENCE, [task_id, fence, key[:255], timezone.now()])


def newer_fence(task_id: str, fence: int) -> int | None:
    """The token of job ``task_id``'s fence row when newer than ``fence`` (``FENCE``)."""
    with connections[settings.database].cursor() as cursor:
        cursor.execute(ledger_sql.FENCE, [task_id, fence])
        row = cursor.fetchone()
    return None if row is None else int(row[0])


__all__ = ["Effect", "Statement", "effect", "newer_fence", "record_fence", "record_takeover"]
