"""Settings of the app, read lazily through one typed object, all prefixed ``EXPLICIT_``.

Read at call time, never at import time or in a model field, so ``override_settings``
works and migrations never depend on settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.conf import settings as django_settings
from django.utils.module_loading import import_string

if TYPE_CHECKING:
    from celery import Celery


class Settings:
    @property
    def celery_app_path(self) -> str | None:
        """``EXPLICIT_CELERY_APP``: dotted path of the Celery app, e.g. ``"shop.celery.app"``.

        Unset: Celery's current app (the one your project's ``celery.py`` created).
        """
        value = getattr(django_settings, "EXPLICIT_CELERY_APP", None)
        return str(value) if value else None

    @property
    def database(self) -> str:
        """``EXPLICIT_DATABASE``: the alias holding the ledger, attempts and dead letters.

        It must be the database your effects write to: the ledger row and the effect
        commit in one transaction.
        """
        return str(getattr(django_settings, "EXPLICIT_DATABASE", "default"))

    @property
    def ledger_round_trips(self) -> bool:
        """``EXPLICIT_LEDGER_ROUND_TRIPS`` (default True): on PostgreSQL with psycopg 3,
        send the ledger's claim with BEGIN and its last writes with COMMIT, so an effect
        costs no more round trips than a bare transaction. Turn off to have every
        statement pass through Django's cursor wrappers (query logging, instrumentation).
        """
        return bool(getattr(django_settings, "EXPLICIT_LEDGER_ROUND_TRIPS", True))

    @property
    def redis_url(self) -> str:
        """``EXPLICIT_REDIS_URL``: the Redis holding locks (default: the Celery broker
        when it is Redis, else redis://127.0.0.1:6379/0)."""
        value = getattr(django_settings, "EXPLICIT_REDIS_URL", None)
        if value:
            return str(value)
        broker = str(self.celery_app().conf.broker_url or "")
        return (
            broker if broker.startswith(("redis://", "rediss://")) else ("redis://127.0.0.1:6379/0")
        )

    def celery_app(self) -> Celery:
        path = self.celery_app_path
        if path:
            app: Celery = import_string(path)
            return app
        from celery import current_app

        return current_app._get_current_object()  # type: ignore[attr-defined,no-any-return]

    @property
    def outbox_batch_size(self) -> int:
        """``EXPLICIT_OUTBOX_BATCH_SIZE`` (default 100): events one relay claims, publishes
        and marks in one transaction. Larger batches publish faster (one Redis pipeline,
        one UPDATE); a relay that dies mid-batch republishes at most this many."""
        return int(getattr(django_settings, "EXPLICIT_OUTBOX_BATCH_SIZE", 100))

    @property
    def outbox_poll_interval(self) -> float:
        """``EXPLICIT_OUTBOX_POLL_INTERVAL`` (default 1.0 s): how long an idle relay waits
        before looking again. With LISTEN/NOTIFY (PostgreSQL) a commit wakes it at once
        and this only catches events whose backoff ran out; without (SQLite, or the
        channel set to ``""``) it is the publish lag."""
        return float(getattr(django_settings, "EXPLICIT_OUTBOX_POLL_INTERVAL", 1.0))

    @property
    def outbox_notify_channel(self) -> str:
        """``EXPLICIT_OUTBOX_NOTIFY_CHANNEL`` (default ``"explicit_outbox"``): the
        PostgreSQL channel a writer NOTIFYs in its transaction and the relay LISTENs on.
        ``""`` turns LISTEN/NOTIFY off (e.g. behind a pooler in transaction mode, where
        LISTEN does not work): the relay polls."""
        return str(getattr(django_settings, "EXPLICIT_OUTBOX_NOTIFY_CHANNEL", "explicit_outbox"))

    @property
    def outbox_max_attempts(self) -> int:
        """``EXPLICIT_OUTBOX_MAX_ATTEMPTS`` (default 10): publish attempts of one event
        that fails by itself (not because the broker is down) before it goes to the dead
        letters with reason ``exhausted``, so it stops holding back its ordering key."""
        return int(getattr(django_settings, "EXPLICIT_OUTBOX_MAX_ATTEMPTS", 10))

    @property
    def outbox_backoff_base(self) -> float:
        """``EXPLICIT_OUTBOX_BACKOFF_BASE`` (default 0.5 s): base of the relay's capped
        exponential backoff with full jitter, after a broker outage or a failed event."""
        return float(getattr(django_settings, "EXPLICIT_OUTBOX_BACKOFF_BASE", 0.5))

    @property
    def outbox_backoff_cap(self) -> float:
        """``EXPLICIT_OUTBOX_BACKOFF_CAP`` (default 30.0 s): the longest such wait; after
        an outage the relay is back within this time of the broker."""
        return float(getattr(django_settings, "EXPLICIT_OUTBOX_BACKOFF_CAP", 30.0))


settings = Settings()
