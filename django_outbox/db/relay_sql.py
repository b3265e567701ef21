"""The relay's statements: the claim of a batch, and the marks that end it.

``outbox.relay.claim`` runs a claim in the batch's transaction; ``outbox.relay.loop``
marks the batch's events and commits. Written out whole, one claim per database, so
what runs is what is read. The table name and the statuses are literals: a unit test
checks them against ``OutboxEvent._meta.db_table`` and ``OutboxStatus``
(``tests/unit/test_outbox_package.py``, ``tests/unit/test_db_statements.py``).
"""

from __future__ import annotations

__all__ = ["CLAIM_POSTGRESQL", "CLAIM_SQLITE", "MARK", "NO_FLUSH"]

# CLAIM_POSTGRESQL - up to LIMIT claimable events, oldest first: pending,
#   available_at passed, and the oldest pending event of their ordering key
# %s the batch size (LIMIT)
# returns (id, event_id as text, task_name, args, kwargs, headers, options,
#   ordering_key, attempts, created_at as epoch seconds), in id order: the fields of
#   outbox.relay.claim.Claimed
# locks the returned rows (FOR UPDATE) until the batch's transaction ends; rows another
#   relay holds are skipped (SKIP LOCKED), not waited for nor published twice
# The lock sits in a MATERIALIZED CTE so the LIMIT is applied before it: inlined, the
# planner may lock more rows than it returns. The head-of-key test is the NOT EXISTS:
# at most one event per key is in flight, across all relays (the previous one, locked
# by another relay, is still pending, so its successor is not claimable). The partial
# indexes on pending rows (id; ordering_key, id) serve both scans. The claimed ids are
# handed to the outer SELECT as one array, read through the primary key: with
# ``IN (SELECT id FROM claimed)`` the planner, which guesses 200 rows for a CTE,
# hash-joined it against a scan of the whole table (33 ms for 500 events out of a
# 20,000-event backlog, against 0.9 ms; each batch cost more the longer the backlog).
# The id comes back as text and the creation time as seconds since the epoch: psycopg
# builds a UUID object per row, and Django's timestamptz loader parses the text in
# Python and sets up per result; loading ten claimed rows took 136 µs with them and
# 18 µs with these casts.
CLAIM_POSTGRESQL = """
WITH claimed AS MATERIALIZED (
    SELECT event.id
    FROM django_outbox_event AS event
    WHERE event.status = 'pending'
      AND event.available_at <= now()
      AND (event.ordering_key = '' OR NOT EXISTS (
            SELECT 1 FROM django_outbox_event AS earlier
            WHERE earlier.ordering_key = event.ordering_key
              AND earlier.status = 'pending'
              AND earlier.id < event.id))
    ORDER BY event.id
    LIMIT %s
    FOR UPDATE OF event SKIP LOCKED
)
SELECT event.id, event.event_id::text, event.task_name, event.args, event.kwargs,
       event.headers, event.options, event.ordering_key, event.attempts,
       extract(epoch FROM event.created_at)::float8
FROM django_outbox_event AS event
WHERE event.id = ANY(ARRAY(SELECT id FROM claimed))
ORDER BY event.id
"""

# CLAIM_SQLITE - the claim on SQLite (and any other database)
# %s the batch size (LIMIT)
# returns the columns of CLAIM_POSTGRESQL, event_id and created_at as stored
# locks nothing: no MATERIALIZED, no row locks, so one relay only
# The database's clock as text in the format Django stores datetimes in. ``%%`` is
# ``%`` once Django substitutes the parameters.
CLAIM_SQLITE = """
WITH claimed AS (
    SELECT event.id
    FROM django_outbox_event AS event
    WHERE event.status = 'pending'
      AND event.available_at <= STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW')
      AND (event.ordering_key = '' OR NOT EXISTS (
            SELECT 1 FROM django_outbox_event AS earlier
            WHERE earlier.ordering_key = event.ordering_key
              AND earlier.status = 'pending'
              AND earlier.id < event.id))
    ORDER BY event.id
    LIMIT %s
)
SELECT event.id, event.event_id, event.task_name, event.args, event.kwargs,
       event.headers, event.options, event.ordering_key, event.attempts,
       event.created_at
FROM django_outbox_event AS event
WHERE event.id IN (SELECT id FROM claimed)
ORDER BY event.id
"""

# NO_FLUSH - the batch's commit does not wait for the WAL flush
# no parameters; returns nothing; locks nothing; for this transaction only (LOCAL)
# A mark lost in a server crash leaves its event pending, and it is published again
# (at least once, as after a relay crash); the flush was the largest cost of a small
# batch.
NO_FLUSH = "SET LOCAL synchronous_commit TO OFF"

# MARK - the batch's events of one new status, marked in the batch's transaction;
#   ``{status}`` the new status, ``{published_at}`` its time (``statement_timestamp()``
#   when published, else ``published_at`` kept), ``{ids}`` the ids, comma-separated
# no parameters: every value is a literal (the ids are integers read from the table,
#   the status one of ours), so all the marks and the COMMIT share one round trip
#   where EXPLICIT_OUTBOX_RELAY_ROUND_TRIPS allows it (a statement with parameters
#   cannot share an execute() with another)
# returns nothing
# locks the rows, which the claim holds already
# One array of ids, not one parameter per event: the ORM's IN list of 500 placeholders
# cost more to compile and bind than the UPDATE did to run. published_at is the
# statement's time, as Django's Now() is: now() is the transaction's start, before the
# messages were sent, and the reconciler compares published_at with the time a queue's
# oldest message was sent (outbox.relay.reconcile).
MARK = """
UPDATE django_outbox_event
SET status = '{status}',
    attempts = attempts + 1,
    published_at = {published_at}
WHERE id = ANY('{{{ids}}}'::bigint[])
"""
