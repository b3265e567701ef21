"""django_outbox: the database side of celery-explicit.

The effect ledger, the attempt audit trail and the dead letters live here, with their
admin, system checks and migrations. Add ``"django_outbox"`` to ``INSTALLED_APPS``.
"""

__all__: list[str] = []
