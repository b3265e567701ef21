"""The relay's claim: which pending outbox events one batch takes, in SQL.

``claim_batch(using, limit)`` runs it in the caller's transaction and
returns the rows as ``Claimed`` (the columns publishing needs, no model instances).

**Several relays, no double publish.** The claim locks its rows with ``FOR UPDATE
SKIP LOCKED``: a second relay skips rows another holds instead of waiting for them or
publishing them too. Each lock sits in a ``MATERIALIZED`` CTE so the ``LIMIT`` is
applied before the lock: inlined, the planner may lock more rows than it returns.

**Order per key.** An event with an ``ordering_key`` is claimed only while no older
event with that key is pending, so at most one event per key is in flight, across all
relays: the next one is claimed after the previous one's publish committed. (The
previous one locked by another relay is still pending, so its successor is not
claimable; ``django_outbox.outbox.events`` makes sure rows of one key are numbered in commit
order.) A key publishes one event per batch; keys proceed in parallel; events without
a key are not held back at all.

**Heads by key, not event by event.** On PostgreSQL the claim takes each key's oldest
pending event among the oldest four batches' worth of events; when that does not fill
the batch and more events wait, a second statement finds the heads beyond them by a
loose index scan, one index descent per key. What a claim reads does not grow with the
events queued behind a head another relay holds. Both are planned with sorts off
(``relay_sql.SORT_OFF``, for the claim only): statistics taken with nothing pending would let the
planner sort the whole backlog instead of reading an index in order.

The statements are written out whole, one set per database, so what runs is what is
read (``django_outbox.db.relay_sql``, with the locks each takes and why it is written so).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple

from django.db import connections
from django.db.transaction import TransactionManagementError
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from django_outbox.conf import settings
from django_outbox.db import libpq, relay_sql
from django_outbox.db.relay_sql import CLAIM_BEYOND_POSTGRESQL, CLAIM_POSTGRESQL, CLAIM_SQLITE

# The claim's statements are importable where the claim is.
__all__ = [
    "CLAIM_BEYOND_POSTGRESQL",
    "CLAIM_POSTGRESQL",
    "CLAIM_SQLITE",
    "STORED_COLUMNS",
    "Call",
    "Claimed",
    "claim_batch",
    "claim_sql",
    "run_claim",
]


def claim_sql(vendor: str) -> str:
    """The claim statement for a database vendor (``connection.vendor``)."""
    return CLAIM_POSTGRESQL if vendor == "postgresql" else CLAIM_SQLITE


#: The four JSON columns a claimed row carries, in the claim's order, and the shape
#: the relay writes each in: what it builds a message from (``Claimed.stored``).
_SHAPES: dict[str, type] = {"args": list, "kwargs": dict, "headers": dict, "options": dict}
STORED_COLUMNS = tuple(_SHAPES)


class Call(NamedTuple):
    """The stored call of a claimed row, parsed: its arguments, headers and options,
    and what is wrong with them (a malformed column is replaced by an empty one so the
    dead letter can be written; the original stays on the outbox row). A named tuple:
    built in C, once per event a relay builds."""

    args: list[Any]
    kwargs: dict[str, Any]
    headers: dict[str, Any]
    options: dict[str, Any]
    #: What is wrong with a row whose columns do not have the shapes the relay
    #: writes (an older row, a hand-made one): it is dead-lettered, not published.
    malformed: str = ""

    @classmethod
    def parse(cls, stored: Sequence[Any]) -> Call:
        args, kwargs, headers, options = stored
        if type(args) is type(kwargs) is type(headers) is type(options) is str:
            # Django's psycopg setup hands jsonb over as text: one parse for the four.
            args, kwargs, headers, options = json.loads(f"[{args},{kwargs},{headers},{options}]")
        else:
            args, kwargs = _json(args), _json(kwargs)
            headers, options = _json(headers), _json(options)
        if (
            isinstance(args, list)
            and isinstance(kwargs, dict)
            and isinstance(headers, dict)
            and isinstance(options, dict)
        ):
            return cls(args, kwargs, headers, options)  # every row the relay writes
        values = dict(zip(STORED_COLUMNS, (args, kwargs, headers, options), strict=True))
        wrong = [
            f"{name} is {type(values[name]).__name__}, not {kind.__name__}"
            for name, kind in _SHAPES.items()
            if not isinstance(values[name], kind)
        ]
        clean = {
            name: values[name] if isinstance(values[name], kind) else kind()
            for name, kind in _SHAPES.items()
        }
        return cls(malformed="; ".join(wrong), **clean)


@dataclass(frozen=True)
class Claimed:
    """The columns of a claimed outbox row that publishing needs (no model instance:
    building one per row costs more than the claim's own query).

    The four JSON columns (``stored``, ``STORED_COLUMNS``) are parsed on first use
    (``call``): a row with a prepared message is pushed as stored and never needs them
    unless it is dead-lettered or built after all, and parsing them cost a relay about
    as much per event as marking the row published."""

    id: int
    event_id: str
    task_name: str
    #: args, kwargs, headers and options as the claim returned them (jsonb text, or
    #: the decoded values): ``call`` parses them.
    stored: tuple[Any, Any, Any, Any]
    ordering_key: str
    attempts: int
    created_at: datetime
    #: The prepared broker message and its label (``django_outbox.outbox.prepared``);
    #: "" when the relay builds the message.
    message: str = ""
    message_format: str = ""

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Claimed:
        id_, event_id, task_name, args, kwargs, headers, options = row[:7]
        key, attempts, created, message, message_format = row[7:]
        return cls(
            id_,
            str(event_id),
            task_name,
            (args, kwargs, headers, options),
            key,
            attempts,
            _aware(created),
            message or "",
            message_format or "",
        )

    @property
    def call(self) -> Call:
        """The stored columns parsed (once)."""
        # Cached by hand: functools.cached_property takes a lock on every first read,
        # which a relay building 500 messages a batch would pay for each.
        parsed: Call | None = self.__dict__.get("_call")
        if parsed is None:
            parsed = Call.parse(self.stored)
            object.__setattr__(self, "_call", parsed)
        return parsed

    @property
    def args(self) -> list[Any]:
        return self.call.args

    @property
    def kwargs(self) -> dict[str, Any]:
        return self.call.kwargs

    @property
    def headers(self) -> dict[str, Any]:
        return self.call.headers

    @property
    def options(self) -> dict[str, Any]:
        return self.call.options

    @property
    def malformed(self) -> str:
        return self.call.malformed


def run_claim(using: str, sql: str, limit: int, *, beyond: bool = False) -> list[Claimed]:
    """Run a claim statement (``%(limit)s`` its one parameter) on the database ``using``,
    in its current transaction; on PostgreSQL with sorts off, as the claims are written
    (``relay_sql.SORT_OFF``). With ``beyond`` (PostgreSQL), fill what it left of the batch
    with ``CLAIM_BEYOND_POSTGRESQL`` when more events wait than it looks at."""
    connection = connections[using]
    if not connection.in_atomic_block:
        # In autocommit the row locks would be released before the caller publishes:
        # as Django refuses select_for_update() there, so does the claim.
        raise TransactionManagementError(
            "the outbox claim locks its rows until commit: run it in transaction.atomic()"
        )
    postgresql = connection.vendor == "postgresql"
    params = {"limit": int(limit)}
    more: bool | None = None  # whether more events wait than the claim looks at
    trips = libpq.for_new_transaction(connection, settings.outbox_relay_round_trips)
    if trips is not None:
        # BEGIN, the claim and the look-ahead's test in one round trip, with sorts off.
        # The limit is the one value: an int, written as such ('%%' becomes '%' as the
        # cursor's binding would make it).
        statements = [sql, relay_sql.BEYOND_LOOKAHEAD] if beyond else [sql]
        sent = [statement % params for statement in statements]
        results = trips.run_all(
            "; ".join(["BEGIN", relay_sql.SORT_OFF, *sent, relay_sql.SORT_DEFAULT])
        )
        rows = trips.rows(results[2])
        if beyond:
            more = trips.rows(results[3])[0][0]
    else:
        with connection.cursor() as cursor:
            if postgresql:
                cursor.execute(relay_sql.SORT_OFF)
            cursor.execute(sql, params)
            rows = cursor.fetchall()
            if postgresql:
                cursor.execute(relay_sql.SORT_DEFAULT)
    claimed = [Claimed.from_row(row) for row in rows]
    if not beyond or len(claimed) >= limit:
        return claimed
    with connection.cursor() as cursor:
        cursor.execute(relay_sql.SORT_OFF)
        if more is None:
            cursor.execute(relay_sql.BEYOND_LOOKAHEAD, params)
            more = cursor.fetchone()[0]
        if more:
            cursor.execute(
                CLAIM_BEYOND_POSTGRESQL,
                {
                    "limit": int(limit) - len(claimed),
                    "batch": int(limit),
                    "after": claimed[-1].id if claimed else 0,
                },
            )
            claimed += [Claimed.from_row(row) for row in cursor.fetchall()]
        cursor.execute(relay_sql.SORT_DEFAULT)
    return claimed


def claim_batch(using: str, limit: int) -> list[Claimed]:
    """Lock and return up to ``limit`` claimable events of database ``using``, oldest first.

    Claimable: pending, ``available_at`` passed, and the oldest pending event of its
    ordering key. Run it in ``transaction.atomic(using=using)``: the rows stay locked,
    hence unclaimable by other relays, until that transaction ends. The claim writes
    (it locks rows), so ``using`` is the database events are written to, never a replica.
    """
    vendor = connections[using].vendor
    return run_claim(using, claim_sql(vendor), limit, beyond=vendor == "postgresql")


def _aware(value: datetime | str | float) -> datetime:
    if isinstance(value, float):
        return datetime.fromtimestamp(value, UTC)  # PostgreSQL's claim: the epoch
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value  # a timestamptz
    # SQLite hands a raw cursor a naive datetime (or text): stored in UTC (USE_TZ).
    parsed = parse_datetime(value) if isinstance(value, str) else value
    if parsed is None:
        raise ValueError(f"created_at {value!r} is not a datetime")
    return parsed if timezone.is_aware(parsed) else timezone.make_aware(parsed, UTC)


def _json(value: Any) -> Any:
    # Django's psycopg setup hands jsonb over as text (JSONField decodes it itself).
    return json.loads(value) if isinstance(value, str | bytes) else value
