"""The Django app's side of ``celery_explicit.store``: where the job path's facts live.

Registered in ``DjangoOutboxConfig.ready``. Each fact goes to the module that owns its
table: the ledger (its entries and the fences), the attempts, the dead letters,
and the unreached (messages that never reached a task).
"""

from __future__ import annotations

from typing import Any

from django_outbox.store import (
    attempts,
    dead_letters,
    key_history,
    ledger,
    periodic_slots,
    unreached,
)


class DjangoStore:
    effect = staticmethod(ledger.effect)
    attempt_statement = staticmethod(attempts.insert_statement)
    record_attempt = staticmethod(attempts.record_attempt)
    record_takeover = staticmethod(ledger.record_takeover)
    record_fence = staticmethod(ledger.record_fence)
    newer_fence = staticmethod(ledger.newer_fence)
    record_hard_timeout = staticmethod(unreached.record_hard_timeout)
    record_undecodable = staticmethod(unreached.record_undecodable)
    earlier_key_templates = staticmethod(key_history.earlier)
    record_key_templates = staticmethod(key_history.record)
    record_slot = staticmethod(periodic_slots.record)

    @staticmethod
    def record_dead_letter(**fields: Any) -> None:
        dead_letters.record(**fields)
