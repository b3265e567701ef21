"""The effect ledger: a business effect happens once per idempotency key.

``effect()`` opens one database transaction and claims the key in it by inserting the
ledger row *first*. A second execution with the same key (a redelivery, a retry, a
concurrent worker) blocks on the unique index until the first transaction ends, then
sees the committed row and is told ``done``. If the first rolls back, its row vanishes
with its effect and the second one applies. The database's unique constraint decides;
no Redis check beforehand could (it would race with the commit).

Usage, inside a task (``ExplicitTask.effect()`` fills in the key)::

    with self.effect() as effect:
        if effect.done:
            return effect.result_ref
        Payment.objects.filter(id=payment_id).update(status="captured")
        effect.result_ref = str(payment_id)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from django.db import connections, transaction
from django.utils import timezone

from celery_explicit.errors import IdempotencyConflict
from django_outbox.conf import settings
from django_outbox.models import ProcessedOperation


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
_RESULT_SQL = f"UPDATE {_table} SET result_ref = %s WHERE key = %s"


@contextmanager
def effect(
    *, key: str, fingerprint: str, task_name: str, task_id: str, using: str | None = None
) -> Iterator[Effect]:
    """One transaction holding the effect and its ledger row.

    Raises ``IdempotencyConflict`` when the key was applied with other arguments: that
    is neither a duplicate to absorb nor a new effect to apply.
    """
    alias = using or settings.database
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        cursor.execute(_CLAIM_SQL, [key, task_name, task_id, fingerprint, timezone.now()])
        row = cursor.fetchone()
        if row is not None:
            claimed = Effect(key=key, fingerprint=fingerprint, done=False)
            yield claimed
            if claimed.result_ref:
                cursor.execute(_RESULT_SQL, [str(claimed.result_ref)[:255], row[0]])
            return
        cursor.execute(_EXISTING_SQL, [key])
        stored_fingerprint, result_ref = cursor.fetchone()
        if stored_fingerprint != fingerprint:
            raise IdempotencyConflict(
                key, stored_fingerprint=stored_fingerprint, fingerprint=fingerprint
            )
        yield Effect(key=key, fingerprint=fingerprint, done=True, result_ref=result_ref)
