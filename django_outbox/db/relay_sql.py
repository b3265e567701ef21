"""The relay's statements: the claim of a batch, and the marks that end it.

``outbox.relay.claim`` runs a claim in the batch's transaction; ``outbox.relay.loop``
marks the batch's events and commits. Written out whole, one claim per database (on
PostgreSQL a statement, a test and a second statement when the first falls short), so
what runs is what is read. The table name and the statuses are literals: a unit test
checks them against ``OutboxEvent._meta.db_table`` and ``OutboxStatus``
(``tests/unit/test_outbox_package.py``, ``tests/unit/test_db_statements.py``).
"""

from __future__ import annotations

__all__ = [
    "BEYOND_LOOKAHEAD",
    "CLAIM_BEYOND_POSTGRESQL",
    "CLAIM_POSTGRESQL",
    "CLAIM_SQLITE",
    "MARK",
    "NO_FLUSH",
    "SORT_DEFAULT",
    "SORT_OFF",
]

# CLAIM_POSTGRESQL - up to LIMIT claimable events, oldest first, among the oldest
#   4 x LIMIT pending events: available_at passed, and the oldest pending event of
#   their ordering key
# %(limit)s the batch size
# returns (id, event_id as text, task_name, args, kwargs, headers, options,
#   ordering_key, attempts, created_at as epoch seconds), in id order: the fields of
#   outbox.relay.claim.Claimed
# locks the returned rows (FOR UPDATE) until the batch's transaction ends; rows another
#   relay holds are skipped (SKIP LOCKED), not waited for nor published twice
# planned with enable_sort off (SORT_OFF); followed by CLAIM_BEYOND_POSTGRESQL when it
#   returns fewer than LIMIT and more events wait beyond its look-ahead
#   (BEYOND_LOOKAHEAD): outbox.relay.claim.run_claim sends them
#
# A key's head is its oldest pending event, whoever holds it: a head another relay has
# locked is skipped, and its successors are not heads, so at most one event per key is
# in flight across all relays. The claim walks the pending events in id order, but only
# the oldest 4 x LIMIT of them: every pending event older than one of those is among
# them, so a keyed event is its key's head if it is the oldest of its key there, one
# hash look-up (the GROUP BY is read only once a keyed event comes up, by the OR). The
# look-ahead bounds what the claim reads: the walk it replaced had no bound and a head
# test against the index for each event, and behind heads another relay held it read
# the whole backlog without filling its LIMIT. Enough while a batch's heads lie in the
# oldest few batches: one relay, or up to four on keys of a few events each.
# The lock sits in a MATERIALIZED CTE so the LIMIT is applied before it: inlined, the
# planner may lock more rows than it returns. The claimed ids are handed to the outer
# SELECT as one array, read through the primary key: with ``IN (SELECT id FROM
# claimed)`` the planner, which guesses 200 rows for a CTE, hash-joined it against a
# scan of the whole table (33 ms for 500 events out of a 20,000-event backlog, against
# 0.9 ms). The id comes back as text and the creation time as seconds since the epoch:
# psycopg builds a UUID object per row, and Django's timestamptz loader parses the text
# in Python and sets up per result; loading ten claimed rows took 136 µs with them and
# 18 µs with these casts.
CLAIM_POSTGRESQL = """
WITH claimed AS MATERIALIZED (
    SELECT event.id
    FROM django_outbox_event AS event
    WHERE event.status = 'pending'
      AND event.available_at <= now()
      AND event.id <= (
            SELECT max(oldest.id)
            FROM (SELECT pending.id
                  FROM django_outbox_event AS pending
                  WHERE pending.status = 'pending'
                  ORDER BY pending.id
                  LIMIT 4 * %(limit)s) AS oldest)
      AND (event.ordering_key = '' OR event.id IN (
            SELECT min(oldest.id)
            FROM (SELECT pending.id, pending.ordering_key
                  FROM django_outbox_event AS pending
                  WHERE pending.status = 'pending'
                  ORDER BY pending.id
                  LIMIT 4 * %(limit)s) AS oldest
            GROUP BY oldest.ordering_key))
    ORDER BY event.id
    LIMIT %(limit)s
    FOR UPDATE OF event SKIP LOCKED
)
SELECT event.id, event.event_id::text, event.task_name, event.args, event.kwargs,
       event.headers, event.options, event.ordering_key, event.attempts,
       extract(epoch FROM event.created_at)::float8, event.message, event.message_format
FROM django_outbox_event AS event
WHERE event.id = ANY(ARRAY(SELECT id FROM claimed))
ORDER BY event.id
"""

# CLAIM_BEYOND_POSTGRESQL - the rest of a batch CLAIM_POSTGRESQL could not fill: up to
#   LIMIT claimable events, oldest first, newer than the oldest 4 x BATCH pending events
#   and than AFTER
# %(limit)s the events still to claim; %(batch)s the batch size; %(after)s the newest id
#   CLAIM_POSTGRESQL returned (0 if none): its events are not taken twice, though one
#   committed since with an older id moves the look-ahead back
# returns the columns of CLAIM_POSTGRESQL, in id order, all newer than CLAIM_POSTGRESQL's
# locks as CLAIM_POSTGRESQL; planned with enable_sort off (SORT_OFF)
# Each key's head by a loose index scan of the partial (ordering_key, id) index, one
# descent per key (``head``), and the unkeyed events in id order: what it reads grows
# with the number of keys, not with the events behind a held head. EXPLAIN ANALYZE on a
# backlog of 20,000 events of 500 keys, another relay holding 500 heads: the walk this
# replaced read all 20,000 events, a head test on each, in 40-60 ms (979 ms where the
# planner took a sequential scan for the head test, SORT_OFF below); CLAIM_POSTGRESQL
# read 2,000 events in 2.6 ms, BEYOND_LOOKAHEAD 2,001 index entries in 0.6 ms, this
# statement one index entry for each of the 500 keys in 4.3 ms. ``ordering_key <= ''``
# is ``= ''`` (no text sorts before the empty string), written so because under an
# equality the planner drops the key from the ORDER BY, and the (id) index is in order
# again.
CLAIM_BEYOND_POSTGRESQL = """
WITH RECURSIVE horizon(id) AS (
    SELECT GREATEST(max(oldest.id), %(after)s)
    FROM (SELECT pending.id
          FROM django_outbox_event AS pending
          WHERE pending.status = 'pending'
          ORDER BY pending.id
          LIMIT 4 * %(batch)s) AS oldest
),
head(ordering_key, id) AS (
    (SELECT first.ordering_key, first.id
     FROM django_outbox_event AS first
     WHERE first.status = 'pending' AND first.ordering_key > ''
     ORDER BY first.ordering_key, first.id
     LIMIT 1)
    UNION ALL
    SELECT next.ordering_key, next.id
    FROM head, LATERAL (
        SELECT first.ordering_key, first.id
        FROM django_outbox_event AS first
        WHERE first.status = 'pending' AND first.ordering_key > head.ordering_key
        ORDER BY first.ordering_key, first.id
        LIMIT 1) AS next
),
claimed AS MATERIALIZED (
    SELECT event.id
    FROM django_outbox_event AS event
    WHERE event.id = ANY(ARRAY(
            SELECT head.id FROM head
            WHERE head.id > (SELECT horizon.id FROM horizon)
            UNION ALL
            (SELECT unkeyed.id
             FROM django_outbox_event AS unkeyed
             WHERE unkeyed.status = 'pending' AND unkeyed.ordering_key <= ''
               AND unkeyed.id > (SELECT horizon.id FROM horizon)
             ORDER BY unkeyed.ordering_key, unkeyed.id
             LIMIT 4 * %(batch)s)))
      AND event.status = 'pending'
      AND event.available_at <= now()
    ORDER BY event.id
    LIMIT %(limit)s
    FOR UPDATE OF event SKIP LOCKED
)
SELECT event.id, event.event_id::text, event.task_name, event.args, event.kwargs,
       event.headers, event.options, event.ordering_key, event.attempts,
       extract(epoch FROM event.created_at)::float8, event.message, event.message_format
FROM django_outbox_event AS event
WHERE event.id = ANY(ARRAY(SELECT id FROM claimed))
ORDER BY event.id
"""

# CLAIM_SQLITE - the claim on SQLite (and any other database)
# %(limit)s the batch size
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
    LIMIT %(limit)s
)
SELECT event.id, event.event_id, event.task_name, event.args, event.kwargs,
       event.headers, event.options, event.ordering_key, event.attempts,
       event.created_at, event.message, event.message_format
FROM django_outbox_event AS event
WHERE event.id IN (SELECT id FROM claimed)
ORDER BY event.id
"""

# BEYOND_LOOKAHEAD - whether more pending events than CLAIM_POSTGRESQL's look-ahead
#   (4 x LIMIT) wait: only then can CLAIM_BEYOND_POSTGRESQL claim anything
# %(limit)s the batch size
# returns one row: true or false
# locks nothing; reads at most 4 x LIMIT + 1 entries of the (id) index, as many as are
#   pending when fewer: sent with CLAIM_POSTGRESQL, in its round trip, so a claim that
#   takes a short backlog whole costs no second one
BEYOND_LOOKAHEAD = """
SELECT EXISTS (
    SELECT 1
    FROM django_outbox_event AS pending
    WHERE pending.status = 'pending'
    ORDER BY pending.id
    OFFSET 4 * %(limit)s)
"""

# SORT_OFF, SORT_DEFAULT - the planner setting the PostgreSQL claims are written for,
#   sent before them in their transaction, and the server's default again after them
# no parameters; return nothing; lock nothing; for this transaction only (LOCAL)
# The planner's statistics of the pending-only indexes are those of the last VACUUM or
# ANALYZE, often taken with little or nothing pending (a drained outbox; autovacuum
# counts the published rows kept towards its threshold), so it costs any read of pending
# events at a row or so. Then it sorts instead of reading an index in order: the (id)
# index read whole and sorted for one key's events (a loose scan of 375 keys took 1.6 s
# so, 3.4 ms through (ordering_key, id)), the whole backlog bitmap-scanned and sorted
# for the oldest 4 x LIMIT. With sorts off, the index in the order asked for is the
# plan. (The walk's head test had no sort to turn off: on such statistics it went
# through the (id) index or a sequential scan, 337 ms instead of 34 for a claim over
# 15,000 events of 375 keys, 979 ms instead of 60 behind 500 held heads.)
SORT_OFF = "SET LOCAL enable_sort TO off"
SORT_DEFAULT = "SET LOCAL enable_sort TO DEFAULT"

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
# oldest message was sent (outbox.relay.reconcile). A prepared message (about 1 kB) is
# cleared: it is spent, and the row's new version need not copy it (nor keep it for the
# outbox's retention); message_format stays, saying the event was sent prepared.
MARK = """
UPDATE django_outbox_event
SET status = '{status}',
    attempts = attempts + 1,
    published_at = {published_at},
    message = ''
WHERE id = ANY('{{{ids}}}'::bigint[])
"""
