"""The effect ledger: a business effect happens once per idempotency key.

``effect()`` opens one database transaction and claims the key in it by inserting the
ledger row *first*. A second execution with the same key (a redelivery, a retry, a
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

import hashlib
import logging
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from celery_explicit.errors import IdempotencyConflict, LeaseLost
from django_outbox.conf import settings
from django_outbox.models import Fence, ProcessedOperation

Statement = tuple[str, Sequence[Any]]

logger = logging.getLogger(__name__)

try:
    from psycopg.pq import TransactionStatus

    _IDLE: Any = TransactionStatus.IDLE
except ImportError:  # psycopg2: _round_trips never gets that far
    _IDLE = None


@dataclass
class Effect:
    key: str
    fingerprint: str
    #: True when this key's effect already committed: do nothing, say so.
    done: bool
    #: A reference to the effect's result (a row id, a downstream id). Set it inside the
    #: block; it is stored with the ledger row and handed to every later duplicate.
    result_ref: str = ""


_table = ProcessedOperation._meta.db_table
# ON CONFLICT DO NOTHING: the insert that loses the race neither raises (which would
# abort the PostgreSQL transaction) nor writes; RETURNING tells us whether we won.
_CLAIM_SQL = (
    f"INSERT INTO {_table} (key, task_name, task_id, fingerprint, result_ref, processed_at) "
    "VALUES (%s, %s, %s, %s, '', %s) ON CONFLICT (key) DO NOTHING RETURNING key"
)
_EXISTING_SQL = f"SELECT fingerprint, result_ref FROM {_table} WHERE key = %s"
# PostgreSQL: claim, or read the row that is already there, in one statement. The read
# uses the statement's snapshot, so a row committed by a concurrent claimant we waited
# for is not visible to it: no row comes back and _EXISTING_SQL reads it afresh.
_CLAIM_OR_READ_SQL = (
    f"WITH claim AS ({_CLAIM_SQL}) "
    "SELECT true, NULL, NULL FROM claim "
    f"UNION ALL SELECT false, fingerprint, result_ref FROM {_table} "
    "WHERE key = %s AND NOT EXISTS (SELECT 1 FROM claim)"
)
_RESULT_SQL = f"UPDATE {_table} SET result_ref = %s WHERE key = %s"

# The fence: a newer execution of this job took its lease over (execution_lease) and
# wrote its token. Read in the effect's own transaction, last before COMMIT, so a stale
# execution that wakes up anywhere before its commit is refused.
_fence_table = Fence._meta.db_table
_FENCE_SQL = f"SELECT token FROM {_fence_table} WHERE task_id = %s AND token > %s"
# The same check for the one-string commit below, which returns no rows to read: a
# fence row turns into an error that aborts the transaction (so COMMIT rolls back). The
# cast reads a column, so PostgreSQL cannot fold it into an error at plan time.
_STALE = "explicit: stale fencing token"
_FENCE_CHECK_SQL = (
    f"SELECT CAST('{_STALE} ' || token AS integer) FROM {_fence_table} "
    "WHERE task_id = %s AND token > %s"
)


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
) -> Iterator[Effect]:
    """One transaction holding the effect and its ledger row.

    ``before_commit`` returns statements to run in the same transaction after the
    block (the attempt row). Raises ``IdempotencyConflict`` when the key was applied
    with other arguments: that is neither a duplicate to absorb nor a new effect.
    ``fence`` is the execution lease's token for job ``task_id``: the commit is
    refused (``StaleFencingToken``, nothing written) when a newer execution took the
    lease over.
    """
    alias = using or settings.database
    connection = connections[alias]
    owns_transaction = not connection.in_atomic_block
    with transaction.atomic(using=alias):
        trips = _round_trips(connection) if owns_transaction else None
        params: list[Any] = [key, task_name, task_id, fingerprint, timezone.now()]
        row: Sequence[Any] | None
        if trips is not None:
            row = trips.begin_and_fetch(_CLAIM_OR_READ_SQL, [*params, key])
        elif connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(_CLAIM_OR_READ_SQL, [*params, key])
                row = cursor.fetchone()
        else:
            with connection.cursor() as cursor:
                cursor.execute(_CLAIM_SQL, params)
                row = (True, None, None) if cursor.fetchone() is not None else None
        if row is None:
            with connection.cursor() as cursor:
                cursor.execute(_EXISTING_SQL, [key])
                stored_fingerprint, result_ref = cursor.fetchone()
            row = (False, stored_fingerprint, result_ref)
        won, stored_fingerprint, result_ref = row
        if won:
            claimed = Effect(key=key, fingerprint=fingerprint, done=False)
        else:
            if stored_fingerprint != fingerprint:
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
        if claimed.result_ref and not claimed.done:
            statements.append((_RESULT_SQL, [str(claimed.result_ref)[:255], key]))
        if before_commit is not None:
            statements += before_commit(claimed)
        if trips is not None:
            if fence is not None:
                statements.append((_FENCE_CHECK_SQL, [task_id, fence]))
            # Committed here; Django's own commit at the end of atomic() then finds the
            # transaction closed and has nothing to do (its on_commit hooks still run).
            try:
                trips.execute_and_commit(statements)
            except DatabaseError as exc:
                # The marker is ours; the server's wording around it may be localized.
                found = re.search(rf"{_STALE} (\d+)", str(exc))
                if found is None:
                    raise
                raise _stale(task_id, key, fence, int(found.group(1))) from None
        else:
            with connection.cursor() as cursor:
                for sql, statement_params in statements:
                    cursor.execute(sql, statement_params)
                if fence is not None:
                    cursor.execute(_FENCE_SQL, [task_id, fence])
                    newer_row = cursor.fetchone()
                    if newer_row is not None:
                        raise _stale(task_id, key, fence, int(newer_row[0]))


def _stale(task_id: str, key: str, fence: int | None, newer: int) -> LeaseLost:
    return LeaseLost(
        f"effect {key!r} of job {task_id}",
        token=fence or 0,
        current=newer,
        why="a newer execution of this job took its lease over",
    )


class _RoundTrips:
    """PostgreSQL only: BEGIN + claim in one round trip, the last writes + COMMIT in one.

    A plain ``atomic()`` costs three round trips (BEGIN, the update, COMMIT); the ledger
    would add two more statements. Sending each with its neighbour keeps the job at
    three, which is what makes the ledger cheap next to a bare transaction
    (docs/performance.md). The statements go through libpq directly, as one simple-query
    string with the parameters bound by psycopg's client-side quoting (the same quoting
    Django's default client-side binding cursor uses), so they do not pass through
    Django's cursor wrappers: ``connection.queries`` and ``execute_wrapper`` hooks do
    not see them. ``EXPLICIT_LEDGER_ROUND_TRIPS = False`` turns this off. It is not
    used with a configured isolation level (plain BEGIN would drop it), and libpq's
    blocking call would stall a gevent/eventlet hub: turn it off with green pools.

    Each statement is also a server-side prepared statement (``EXPLICIT_LEDGER_PREPARED``):
    its ``PREPARE`` travels in front of its first use on a connection, and from then on
    only ``EXECUTE name(values)`` does. Planning the claim (a CTE around an INSERT) took
    about 100 us of a 400 us effect on the development machine.
    """

    def __init__(self, connection: Any, raw: Any, session: _Session) -> None:
        self._connection = connection
        self._raw = raw
        self._quote = session.quote
        self._prepared = session if settings.ledger_prepared else None
        if self._prepared is not None and self._prepared.stale:
            # No transaction is open yet (_round_trips checked): one round trip on its own.
            self._prepared.resync(raw.pgconn)

    def begin_and_fetch(self, sql: str, params: Sequence[Any]) -> tuple[Any, ...] | None:
        """The first row, decoded as text (``t``/``f`` for booleans), or None."""
        result = self._run([(sql, params)], begin=True)
        if not result.ntuples:
            return None
        encoding = self._raw.info.encoding
        values = [result.get_value(0, i) for i in range(result.nfields)]
        decoded = [None if v is None else bytes(v).decode(encoding) for v in values]
        return (decoded[0] == "t", *decoded[1:])

    def execute_and_commit(self, statements: list[Statement]) -> None:
        result = self._run(statements, commit=True)
        # COMMIT of an aborted transaction "succeeds" with the tag ROLLBACK.
        if result.command_status != b"COMMIT":
            raise DatabaseError(
                f"the effect's transaction did not commit ({result.command_status!r})"
            )

    def _run(
        self, statements: Sequence[Statement], *, begin: bool = False, commit: bool = False
    ) -> Any:
        from psycopg import errors, pq

        prepares: list[str] = []
        runs: list[str] = []
        names: list[str] = []
        for sql, params in statements:
            prepare, run, name = self._statement(sql, params)
            if prepare is not None:
                prepares.append(prepare)
                names.append(name)
            runs.append(run)
        # The PREPAREs go first: they are not undone by a rollback, and an error in
        # a later statement leaves them made.
        parts = [*prepares, *(["BEGIN"] if begin else []), *runs, *(["COMMIT"] if commit else [])]
        # libpq stops at the first failing statement of the string: a failed write never
        # reaches the COMMIT after it, and the transaction is left aborted for Django's
        # rollback.
        result = self._raw.pgconn.exec_("; ".join(parts).encode())
        if result.status in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK):
            if self._prepared is not None:
                self._prepared.names.update(names)
            return result
        prepared = self._prepared
        if prepared is not None:
            # Which PREPAREs ran is unknown when one of them failed: ask the server
            # before the next effect on this connection.
            prepared.stale = bool(names) or prepared.stale
            sqlstate = result.error_field(pq.DiagnosticField.SQLSTATE)
            if sqlstate == b"26000" and not prepared.off:
                # Our statements are gone: DISCARD ALL, or a proxy that hands each
                # transaction another server connection. Stop preparing on this one.
                prepared.off = True
                logger.warning(
                    "the ledger's prepared statements disappeared from this database "
                    "connection; running them unprepared from now on (behind PgBouncer "
                    "in transaction mode, set EXPLICIT_LEDGER_PREPARED = False)"
                )
                if begin:
                    # Nothing of the effect ran yet: roll back the BEGIN, go again.
                    self._raw.pgconn.exec_(b"ROLLBACK")
                    return self._run(statements, begin=begin, commit=commit)
        with self._connection.wrap_database_errors:
            raise errors.error_from_result(result, encoding=self._raw.info.encoding)

    def _statement(self, sql: str, params: Sequence[Any]) -> tuple[str | None, str, str]:
        """(PREPARE or None, the statement to run, the prepared name or "")."""
        prepared = self._prepared
        if prepared is None or prepared.off or "%%" in sql:
            return None, self._quote(sql, params), ""
        name = "explicit_" + hashlib.sha1(sql.encode()).hexdigest()[:20]
        values = self._quote(", ".join(["%s"] * len(params)), params) if params else ""
        run = f"EXECUTE {name}({values})" if params else f"EXECUTE {name}"
        if name in prepared.names:
            return None, run, name
        if len(prepared.names) >= _MAX_PREPARED:
            return None, self._quote(sql, params), ""
        pieces = sql.split("%s")
        numbered = pieces[0] + "".join(f"${i}{p}" for i, p in enumerate(pieces[1:], 1))
        return f"PREPARE {name} AS {numbered}", run, name


#: Distinct ledger statements prepared on one connection at most (there are a handful).
_MAX_PREPARED = 32


@dataclass
class _Session:
    """What the fast path keeps per database connection (one server session)."""

    #: psycopg's client-side quoting, bound to this connection's adapters.
    quote: Callable[..., str]
    #: The ledger's statements prepared on this session.
    names: set[str] = field(default_factory=set)
    #: A string with PREPAREs failed part-way: read the names back from the server.
    stale: bool = False
    #: The server lost them once (a proxy, DISCARD ALL): never prepare here again.
    off: bool = False

    def resync(self, pgconn: Any) -> None:
        # Outside any transaction (the effect has not begun): its own implicit one.
        result = pgconn.exec_(
            b"SELECT name FROM pg_prepared_statements WHERE starts_with(name, 'explicit_')"
        )
        self.names = {bytes(result.get_value(i, 0)).decode() for i in range(result.ntuples)}
        self.stale = False


# Keyed by psycopg's connection object: a reconnect (a new object, a new server
# session) starts afresh. Kept so an effect does not rebuild it (bench P2).
_sessions: weakref.WeakKeyDictionary[Any, _Session] = weakref.WeakKeyDictionary()


def _round_trips(connection: Any) -> _RoundTrips | None:
    """The fast path, when this transaction is ours and has not started on the server."""
    if not settings.ledger_round_trips or connection.vendor != "postgresql":
        return None
    raw = connection.connection
    try:
        session = _sessions.get(raw)
    except TypeError:  # not weakly referenceable: no connection, or another driver
        return None
    if session is None:
        try:
            import psycopg
        except ImportError:  # psycopg2: the plain path
            return None
        if not isinstance(raw, psycopg.Connection):
            return None
        session = _sessions[raw] = _Session(quote=psycopg.ClientCursor(raw).mogrify)
    if raw.autocommit:
        return None
    if raw.isolation_level is not None or raw.read_only is not None or raw.deferrable:
        # psycopg would begin with these options; a bare BEGIN would silently drop them.
        return None
    if raw.pgconn.transaction_status != _IDLE:
        return None
    return _RoundTrips(connection, raw, session)
