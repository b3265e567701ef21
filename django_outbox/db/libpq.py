"""Fewer round trips to PostgreSQL: BEGIN travels with a transaction's first statements,
COMMIT with its last.

A transaction through Django's cursor costs a round trip for BEGIN (psycopg sends it
alone, before the first statement) and one for COMMIT. The ledger and the
outbox relay send a few statements a transaction, so those two are a large share of
their time; under a CPU hog each round trip also waits for the processes at both ends
to be scheduled again (bench/outbox_lag.py). Sending ``BEGIN; ...`` and ``...; COMMIT``
as one simple-query string each removes both.

The statements go through libpq directly, so Django's cursor wrappers
(``connection.queries``, ``execute_wrapper`` hooks) do not see them; each user has a
setting to turn this off (``EXPLICIT_LEDGER_ROUND_TRIPS``,
``EXPLICIT_OUTBOX_RELAY_ROUND_TRIPS``). Used only where a plain BEGIN is what psycopg
would send (no isolation level, read-only or deferrable option configured), with
psycopg 3, and only for a transaction that has not started on the server yet.

**Django's transaction stays in charge.** After ``commit_with()`` the server is idle,
so Django's own commit at the end of ``atomic()`` has nothing to send (psycopg skips
COMMIT on an idle connection) and its ``on_commit`` hooks still run. A failing
statement raises Django's ``DatabaseError`` (libpq runs nothing after it, so a COMMIT
behind a failed write never runs) and ``atomic()`` rolls back as usual. A COMMIT that
the server turns into ROLLBACK (the transaction was aborted) raises too.
"""

from __future__ import annotations

import select
from collections.abc import Callable, Sequence
from typing import Any

from django.db import DatabaseError

try:
    import psycopg
    from psycopg import errors as pg_errors
    from psycopg import pq
    from psycopg.adapt import Transformer
except ImportError:  # psycopg2 only: nothing here is used (the plain path is taken)
    psycopg = None  # type: ignore[assignment]
else:
    # Resolved once: an import statement and enum look-ups in a function called four
    # times a job cost more than the rest of it (py-spy, bench/cpu_per_job.py).
    _OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)
    _IDLE = pq.TransactionStatus.IDLE
    _INTRANS = pq.TransactionStatus.INTRANS

__all__ = ["RoundTrips", "for_commit", "for_new_transaction"]


class RoundTrips:
    """One Django connection's psycopg 3 connection, for strings of statements."""

    def __init__(self, connection: Any, raw: Any) -> None:
        self.connection = connection
        self.raw = raw

    def run_all(self, query: str) -> list[Any]:
        """Each statement's result (libpq ``PGresult``) of ``query``, in order; the first
        failing one raises (libpq runs no statement after it)."""
        with self.connection.wrap_database_errors:
            pgconn = self.raw.pgconn
            pgconn.send_query(query.encode())
            results = []
            while True:
                # libpq's PQgetResult blocks while holding the GIL when the reply is
                # not in yet (a thread of the same process committing the row a claim
                # waits for would never run): wait on the socket, which lets it go.
                while pgconn.is_busy():
                    select.select([pgconn.socket], [], [])
                    pgconn.consume_input()
                result = pgconn.get_result()
                if result is None:
                    break
                results.append(result)
            for result in results:
                self._raise_on_error(result)
        return results

    def _run(self, query: str) -> Any:
        """The last statement's result of ``query`` (libpq's ``PQexec``, which waits
        without the GIL)."""
        with self.connection.wrap_database_errors:
            # libpq stops at the first failing statement of the string: a failed write
            # never reaches a COMMIT after it, and the transaction is left aborted for
            # Django's rollback.
            result = self.raw.pgconn.exec_(query.encode())
            self._raise_on_error(result)
        return result

    def commit_with(self, statements: Sequence[str], *, what: str) -> None:
        """Run ``statements`` (SQL with every value already in it), then COMMIT, in one
        round trip. ``what`` names the transaction in the error when it did not commit."""
        result = self._run("; ".join([*statements, "COMMIT"]))
        # COMMIT of an aborted transaction "succeeds" with the tag ROLLBACK.
        if result.command_status != b"COMMIT":
            raise DatabaseError(f"{what} did not commit ({result.command_status!r})")

    def literal_escaper(self) -> Callable[[bytes], bytes]:
        """libpq's ``PQescapeLiteral`` on this connection (its encoding, its
        ``standard_conforming_strings``)."""
        return pq.Escaping(self.raw.pgconn).escape_literal

    def rows(self, result: Any) -> list[tuple[Any, ...]]:
        """``result``'s rows as Python values, loaded by the connection's own adapters
        (those Django configured: the same values its cursor would return)."""
        transformer = Transformer(self.raw)
        transformer.set_pgresult(result)
        return transformer.load_rows(0, result.ntuples, tuple)

    def _raise_on_error(self, result: Any) -> None:
        if result.status not in _OK:
            raise pg_errors.error_from_result(result, encoding=self.raw.info.encoding)


def for_new_transaction(connection: Any, enabled: bool) -> RoundTrips | None:
    """``RoundTrips`` for ``connection`` when ``enabled`` and usable: PostgreSQL through
    psycopg 3, inside ``atomic()`` (not autocommit), no transaction option a plain
    BEGIN would drop, and the transaction not begun on the server yet. None otherwise:
    the caller takes Django's cursor."""
    raw = _psycopg_in_atomic(connection, enabled)
    if raw is None:
        return None
    if raw.isolation_level is not None or raw.read_only is not None or raw.deferrable:
        # psycopg would begin with these options; a bare BEGIN would silently drop them.
        return None
    if raw.pgconn.transaction_status != _IDLE:
        return None
    return RoundTrips(connection, raw)


def for_commit(connection: Any, enabled: bool) -> RoundTrips | None:
    """``RoundTrips`` for committing ``connection``'s open transaction with its last
    statements, when ``enabled`` and usable: PostgreSQL through psycopg 3, a
    transaction open on the server and not marked for rollback by Django (a caught
    error inside ``atomic()``: Django must roll it back, not we commit it). The caller
    must own the transaction (its ``atomic()`` is the outermost). None otherwise."""
    raw = _psycopg_in_atomic(connection, enabled)
    if raw is None or connection.needs_rollback:
        return None
    if raw.pgconn.transaction_status != _INTRANS:
        return None
    return RoundTrips(connection, raw)


def _psycopg_in_atomic(connection: Any, enabled: bool) -> Any:
    """``connection``'s psycopg 3 connection when ``enabled``, on PostgreSQL and out of
    autocommit (inside ``atomic()``); None otherwise."""
    if not enabled or psycopg is None or connection.vendor != "postgresql":
        return None
    raw = connection.connection
    if not isinstance(raw, psycopg.Connection) or raw.autocommit:
        return None
    return raw
