"""The ledger's statements, and the fence's: the SQL of an effect's transaction.

``store.ledger.effect()`` claims the job's key by inserting its ledger entry first,
reads the stored entry when the claim lost, writes the result, and before COMMIT reads
the fence a newer execution may have written (``store.ledger.record_takeover``).

Each statement is written out whole, the table names as literals
(``tests/unit/test_db_statements.py`` checks them against the models). The
parameters are ``%s`` placeholders and nothing else holds a ``%``: the fast path binds
them itself as literals (``store.ledger``, ``sql % literals``).
"""

from __future__ import annotations

__all__ = [
    "CANCELLED",
    "CANCELLED_CHECK",
    "CANCELLED_END",
    "CANCELLED_MARKER",
    "CANCEL_EXCLUSIVE",
    "CANCEL_LOCK",
    "CLAIM",
    "EXISTING",
    "EXISTING_UNDER_ANY",
    "FENCE",
    "FENCE_CHECK",
    "RESULT",
    "RAISE_FENCE",
    "STALE_MARKER",
    "TAKEOVER",
]

# CLAIM - the job's key, claimed by inserting its ledger entry first
# %s key, task_name, task_id, fingerprint, processed_at, app_version
# returns one row (the key) when this transaction claimed it; no row when another
#   transaction holds it or committed it
# locks the key in the primary key's index until this transaction ends: a concurrent
#   claim of the same key waits for it, then finds the row (or claims, on a rollback)
# ON CONFLICT DO NOTHING: the insert that loses the race neither raises (which would
# abort the PostgreSQL transaction) nor writes; RETURNING tells us whether we won. The
# key is the primary key, so its unique index is the claim, with no second index.
CLAIM = (
    "INSERT INTO django_outbox_processed_operation "
    "(key, task_name, task_id, fingerprint, result_ref, processed_at, app_version) "
    "VALUES (%s, %s, %s, %s, '', %s, %s) ON CONFLICT (key) DO NOTHING RETURNING key"
)

# EXISTING - the stored entry of a key, read when the claim lost
# %s key
# returns (fingerprint, result_ref), or no row (pruned since the claim lost)
# locks nothing
# A plain statement after the claim, so it takes a new snapshot and sees the row of a
# concurrent claimant the claim waited for. On the fast path it travels with BEGIN and
# the claim (one round trip; a first run reads a row it does not need). A CTE that
# claimed or read in one statement cost PostgreSQL about 190 µs more a transaction, on
# every first run (bench/effect_ceiling.py).
EXISTING = "SELECT fingerprint, result_ref FROM django_outbox_processed_operation WHERE key = %s"

# EXISTING_UNDER_ANY - the stored entry under any of a job's other keys (a renamed key
#   template, celery_explicit.key_history); ``{placeholders}``: one ``%s`` per key
# %s each key
# returns (fingerprint, result_ref) of one of them, or no row
# locks nothing
# One statement whatever the number of keys; read only for a job that has other keys.
EXISTING_UNDER_ANY = (
    "SELECT fingerprint, result_ref FROM django_outbox_processed_operation "
    "WHERE key IN ({placeholders}) LIMIT 1"
)

# RESULT - the result a later duplicate is handed, on the entry this transaction claimed
# %s result_ref, key
# returns nothing
# locks the entry's row (this transaction inserted it, or holds it already)
RESULT = "UPDATE django_outbox_processed_operation SET result_ref = %s WHERE key = %s"

# FENCE - a newer execution of this job took its lease over and wrote its token
# %s task_id, this execution's fencing token
# returns (token) of the newer execution, or no row
# locks nothing
# Read in the effect's own transaction, last before COMMIT, so a stale execution that
# wakes up anywhere before its commit is refused.
FENCE = "SELECT token FROM django_outbox_fence WHERE task_id = %s AND token > %s"

#: The error FENCE_CHECK raises starts with this, then the newer token.
STALE_MARKER = "explicit: stale fencing token"

# FENCE_CHECK - FENCE for the fast path's one-string commit, which returns no rows to
#   read: a fence row turns into an error that aborts the transaction (COMMIT then
#   rolls back)
# %s task_id, this execution's fencing token
# returns no row, or fails with "<STALE_MARKER> <newer token>" (not an integer)
# locks nothing
# The cast reads a column, so PostgreSQL cannot fold it into an error at plan time.
FENCE_CHECK = (
    f"SELECT CAST('{STALE_MARKER} ' || token AS integer) FROM django_outbox_fence "
    "WHERE task_id = %s AND token > %s"
)

# CANCEL_LOCK - the job's cancellation locks, shared, taken by a cancellable job's effect
#   before it reads the cancellations (CANCELLED, CANCELLED_CHECK)
# %s task_id, key
# returns one row of two voids
# locks two transaction-level advisory locks, shared, until this transaction ends
# A cancel takes the same two exclusively (CANCEL_EXCLUSIVE) while it writes its row
# and reads the ledger: one of the two waits for the other, so a cancel acknowledged
# before this commit refuses it, and a commit that came first makes the cancel say
# "already applied". Task id first, then key, in both: no deadlock. PostgreSQL only.
CANCEL_LOCK = (
    "SELECT pg_advisory_xact_lock_shared(hashtext('explicit-cancel-id:' || %s)), "
    "pg_advisory_xact_lock_shared(hashtext('explicit-cancel-key:' || %s))"
)

# CANCEL_EXCLUSIVE - CANCEL_LOCK's two locks, exclusive, for a cancel
# %s task_id, key ("" for the one the cancel does not name)
# returns one row of two voids
# locks the two advisory locks until the cancel's transaction ends
CANCEL_EXCLUSIVE = (
    "SELECT pg_advisory_xact_lock(hashtext('explicit-cancel-id:' || %s)), "
    "pg_advisory_xact_lock(hashtext('explicit-cancel-key:' || %s))"
)

# CANCELLED - who cancelled the job, read in its effect's transaction
# %s task_id, key
# returns (requested_by), or no row
# locks nothing
CANCELLED = (
    "SELECT requested_by FROM django_outbox_cancellation "
    "WHERE task_id = %s OR idempotency_key = %s LIMIT 1"
)

#: The error CANCELLED_CHECK raises holds ``<CANCELLED_MARKER> <who> <CANCELLED_END>``:
#: ours at both ends, so the server's own wording and quotes (localized) never matter.
CANCELLED_MARKER = "explicit: cancelled by"
CANCELLED_END = ":explicit-end"

# CANCELLED_CHECK - CANCELLED for the fast path's one-string commit: a cancellation
#   row turns into an error that aborts the transaction (COMMIT then rolls back)
# %s task_id, key
# returns no row, or fails with "<CANCELLED_MARKER> <who> <CANCELLED_END>" (not an
#   integer)
# locks nothing
CANCELLED_CHECK = (
    f"SELECT CAST('{CANCELLED_MARKER} ' || requested_by || ' {CANCELLED_END}' AS integer) "
    "FROM django_outbox_cancellation WHERE task_id = %s OR idempotency_key = %s LIMIT 1"
)

# TAKEOVER - the newer fence of a job, announced before its new execution runs
# %s task_id, token, idempotency_key, taken_over_from, taken_over_at,
#    holder_started_at, cause
# returns nothing
# locks the job's fence row until the statement's autocommit
# Upsert to the larger token: two takeovers racing leave the newer one, and a stale
# holder's effect reads it in its commit (FENCE). Written only on a takeover, so the
# common path never pays for it; it keeps the execution taken over (its start, why it
# lost its lease), which explain tells an execution that died from.
TAKEOVER = (
    "INSERT INTO django_outbox_fence (task_id, token, idempotency_key, taken_over_from, "
    "taken_over_at, holder_started_at, cause) VALUES (%s, %s, %s, %s, %s, %s, %s) "
    "ON CONFLICT (task_id) DO UPDATE "
    "SET token = excluded.token, idempotency_key = excluded.idempotency_key, "
    "taken_over_from = excluded.taken_over_from, taken_over_at = excluded.taken_over_at, "
    "holder_started_at = excluded.holder_started_at, cause = excluded.cause "
    "WHERE django_outbox_fence.token < excluded.token"
)

# RAISE_FENCE - a fence for a redelivered job whose execution lease was free: a newer
#   token than any earlier execution could hold, with no execution named as taken over
# %s task_id, token, idempotency_key, taken_over_at
# returns nothing
# locks the job's fence row until the statement's autocommit
# Only the token moves when the row exists: a takeover's row keeps the execution it
# names (explain counts it), and this one names none (cause 'unleased').
RAISE_FENCE = (
    "INSERT INTO django_outbox_fence (task_id, token, idempotency_key, taken_over_from, "
    "taken_over_at, holder_started_at, cause) VALUES (%s, %s, %s, '', %s, NULL, 'unleased') "
    "ON CONFLICT (task_id) DO UPDATE SET token = excluded.token "
    "WHERE django_outbox_fence.token < excluded.token"
)
