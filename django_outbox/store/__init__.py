"""The job path's facts in PostgreSQL: what ``celery_explicit.store`` is implemented with.

- ``ledger``: the ledger (one ledger entry per applied effect, and the fences of
  executions taken over), written in the effect's own transaction.
- ``attempts``: the attempts, a row per execution with its outcome.
- ``dead_letters``: jobs given up on, with why, kept until replayed or discarded.
- ``unreached``: messages that never reached a task (unknown name, undecodable body),
  recorded as dead letters by Celery signal receivers.
- ``key_history``: each task's idempotency key templates, so a renamed template still
  finds its effects.
- ``guarded_writes``: ``fenced_update`` and ``versioned_update`` for business rows.
- ``backend``: ``DjangoStore``, the object ``celery_explicit.store`` calls.
"""
