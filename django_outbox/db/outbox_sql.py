"""The outbox's statements on PostgreSQL: the writer's row, its lock and its NOTIFY, and
the relays' LISTEN.

``outbox.events.write`` inserts an outbox row in the caller's business transaction;
its NOTIFY wakes an idle relay at commit (``outbox.relay.wakeup`` LISTENs), and so does
the admin's "retry now". SQLite writes through the ORM and relays poll there.

The table name and the ``'pending'`` status are written out
(``tests/unit/test_db_statements.py`` checks them against ``OutboxEvent``).
"""

from __future__ import annotations

__all__ = [
    "INSERT_EVENT",
    "LISTEN",
    "NOTIFY",
    "NOTIFY_RETURNING",
    "ORDERING_LOCK",
    "ORDERING_LOCK_FAMILY",
]

#: The first of ORDERING_LOCK's pair of keys: it names our lock family ("outbox"), so an
#: application's own advisory locks (one bigint, or other pairs) never collide with it.
ORDERING_LOCK_FAMILY = 0x0E0B

# ORDERING_LOCK - the writers of one ordering key, one at a time until commit
# %s ORDERING_LOCK_FAMILY, the ordering key
# returns one row (void)
# locks the advisory lock (family, hashtext(key)) until the transaction ends
# Taken before the insert, so the lock is held when the row takes its number: two
# transactions writing one key commit in the order their rows were numbered, and the
# relay's "oldest first" is also "first committed first". They serialise on that key
# until commit, never across keys.
ORDERING_LOCK = "SELECT pg_advisory_xact_lock(%s, hashtext(%s))"

# INSERT_EVENT - one pending outbox row
# %s event_id, task_name, args, kwargs, headers, options (JSON text each), ordering_key,
#    status ('pending'), message, message_format (prepared messages: '' and '' if none)
# returns nothing (or NOTIFY_RETURNING's row, when that is appended)
# locks nothing but the new row
# created_at and available_at take the database's clock (their db_default): the claim
# compares available_at with now(). One statement rather than the ORM's insert and a
# NOTIFY: the write sits in the caller's business transaction, and costs it as few
# round trips as the ledger's claim.
INSERT_EVENT = (
    "INSERT INTO django_outbox_event (event_id, task_name, args, kwargs, headers, options, "
    "ordering_key, status, attempts, last_error, message, message_format) "
    "VALUES (%s, %s, %s::jsonb, %s::jsonb, %s::jsonb, %s::jsonb, %s, %s, 0, '', %s, %s)"
)

# NOTIFY_RETURNING - appended to INSERT_EVENT: the NOTIFY rides on the insert
# %s the channel (EXPLICIT_OUTBOX_NOTIFY_CHANNEL)
# returns one row (void)
# locks nothing
# A NOTIFY is delivered at commit, and only then, wherever it sits in the transaction;
# PostgreSQL folds identical notifications of one transaction into one, so a
# transaction writing many events wakes the relays once.
NOTIFY_RETURNING = " RETURNING pg_notify(%s, '')"

# NOTIFY - wake the relays (the admin's "retry now", after moving events' backoff)
# %s the channel
# returns one row (void)
# locks nothing; delivered when the surrounding transaction commits
NOTIFY = "SELECT pg_notify(%s, '')"

# LISTEN - a relay's wake-up channel, on its own autocommit connection
# {} the channel, as an identifier (psycopg's sql.Identifier quotes it)
# returns nothing; each NOTIFY on the channel arrives on that connection
# locks nothing
# LISTEN takes no parameter: the channel is composed in as an identifier, never as text.
LISTEN = "LISTEN {}"
