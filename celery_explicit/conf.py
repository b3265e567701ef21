"""Every setting of celery-explicit, read lazily through one typed object.

Each attribute of ``settings`` is the Django setting ``EXPLICIT_<NAME>`` (e.g.
``settings.redis_url`` is ``EXPLICIT_REDIS_URL``). Read at call time, never at import
time or in a model field, so ``override_settings`` works and migrations never depend on
settings. The switches marked *environment* may also come from an environment variable
of the same name (a Django setting wins): they exist to turn a mechanism off on one
worker during an incident or a negative-control test, without a deploy. No other
module reads ``os.environ`` or ``django.conf.settings`` for our options.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from django.conf import settings as django_settings
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

if TYPE_CHECKING:
    from celery import Celery

T = TypeVar("T")
PREFIX = "EXPLICIT_"
_MISSING = object()


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)


class Setting(Generic[T]):
    """``EXPLICIT_<NAME>``, cast to ``T``; ``env=True`` also reads the environment."""

    def __init__(self, default: T, cast: Callable[[Any], T], *, env: bool = False) -> None:
        self.default, self.cast, self.env = default, cast, env
        self.name = ""

    def __set_name__(self, owner: type, attribute: str) -> None:
        self.attribute = attribute
        self.name = PREFIX + attribute.upper()

    @overload
    def __get__(self, obj: None, owner: type) -> Setting[T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> T: ...
    def __get__(self, obj: object | None, owner: type) -> T | Setting[T]:
        if obj is None:
            return self
        # A process without Django settings (a bench, a one-off script) gets defaults.
        value = _MISSING
        if django_settings.configured:
            value = getattr(django_settings, self.name, _MISSING)
        if value is _MISSING and self.env:
            value = os.environ.get(self.name, _MISSING)
        result = self.default if value is _MISSING or value is None else self.cast(value)
        if django_settings.configured and not self.env:
            # Kept on the instance, which then answers without this method: a job reads
            # a dozen settings, and a Django setting that is not set costs an
            # AttributeError each time. ``setting_changed`` (override_settings, the
            # test ``settings`` fixture) empties it. Switches that an environment
            # variable may turn are read every time.
            obj.__dict__[self.attribute] = result
        return result


def _forget(**_: Any) -> None:
    """``setting_changed``: read every setting again."""
    settings.__dict__.clear()


setting_changed.connect(_forget, dispatch_uid="celery_explicit.conf")


class Settings:
    #: Dotted path of the Celery app (``"shop.celery.app"``); unset: Celery's current app.
    celery_app_path: Setting[str] = Setting("", str)
    #: The alias holding the ledger, attempts and dead letters: the database your
    #: effects write to (the ledger row and the effect commit in one transaction).
    database: Setting[str] = Setting("default", str)
    #: The Redis holding leases, locks, dedup marks, ordering and downstream state;
    #: unset: the Celery broker when it is Redis, else redis://127.0.0.1:6379/0.
    redis_url_setting: Setting[str] = Setting("", str)
    #: Prefix of every Redis key we write (an operator finds them all under it).
    key_prefix: Setting[str] = Setting("explicit:", str)
    #: PostgreSQL + psycopg 3: the ledger's claim rides with BEGIN and its last writes
    #: with COMMIT (no extra round trips). Off: every statement through Django's cursor.
    ledger_round_trips: Setting[bool] = Setting(True, _flag)
    #: *environment* Off: every delivery runs without an execution lease or a fence.
    execution_lease: Setting[bool] = Setting(True, _flag, env=True)
    #: *environment* Off: message and execution leases are not extended (they run out).
    lease_extend: Setting[bool] = Setting(True, _flag, env=True)
    #: *environment* Off: an effect is checked only under the key this worker renders,
    #: not under the key its message was published with nor the task's earlier key
    #: templates (``celery_explicit.key_history``; a negative-control switch).
    key_history: Setting[bool] = Setting(True, _flag, env=True)
    #: *environment* Off: a worker in warm shutdown stops extending the leases of the
    #: jobs it is still draining (Celery's own behaviour: they run out mid-job).
    drain_heartbeat: Setting[bool] = Setting(True, _flag, env=True)
    #: *environment* Off (Redis broker): an ack removes the broker's record of a
    #: delivery by its tag even when another worker holds that delivery now (kombu's
    #: own behaviour: a stale copy's ack drops the live copy's record).
    delivery_holder: Setting[bool] = Setting(True, _flag, env=True)
    #: *environment* Off (Redis broker): kombu's ``BRPOP`` takes a message off its queue
    #: and the worker records it as delivered in a second command; a worker killed
    #: between the two loses it (kombu's own behaviour; a negative-control switch).
    atomic_fetch: Setting[bool] = Setting(True, _flag, env=True)
    #: Seconds, the longest a job waits between two tries while the database cannot be
    #: written (``celery_explicit.database_outage``; backoff from 1 s, equal jitter).
    database_outage_backoff_cap: Setting[float] = Setting(30.0, float)
    #: *environment* Off: a database outage is classified by the task's retry policy
    #: like any other error (dead-lettered or retried within ``max_attempts``; a
    #: negative-control switch).
    database_outage: Setting[bool] = Setting(True, _flag, env=True)
    #: *environment* Off (Redis broker): kombu's sweep compares the message leases'
    #: scores with the sweeping host's own clock, not the Redis server's (kombu's own
    #: behaviour; a negative-control switch).
    server_clock: Setting[bool] = Setting(True, _flag, env=True)
    #: A worker refuses to start while ``manage.py check`` reports one of our errors
    #: (``django_outbox.E*``: a contract, the broker's backstop, pickle). True: it
    #: starts anyway and logs them as warnings (an escape hatch, not a default).
    start_despite_check_errors: Setting[bool] = Setting(False, _flag)
    #: A worker refuses to start on a Celery or kombu outside the tested ranges
    #: (``celery_explicit.versions.TESTED``). True: it starts, logs one warning, and
    #: ``manage.py check`` reports ``django_outbox.W005`` (an override, not a default).
    allow_untested_versions: Setting[bool] = Setting(False, _flag)
    #: Events one relay claims, publishes and marks in one transaction.
    outbox_batch_size: Setting[int] = Setting(100, int)
    #: PostgreSQL + psycopg 3: the relay's claim rides with BEGIN and its marks with
    #: COMMIT (three round trips a batch, not five). Off: every statement through
    #: Django's cursor.
    outbox_relay_round_trips: Setting[bool] = Setting(True, _flag)
    #: Seconds an idle relay waits before looking again (with LISTEN/NOTIFY a commit
    #: wakes it at once; without, this is the publish lag).
    outbox_poll_interval: Setting[float] = Setting(1.0, float)
    #: The PostgreSQL channel writers NOTIFY and the relay LISTENs on; "" polls.
    outbox_notify_channel: Setting[str] = Setting("explicit_outbox", str)
    #: Publish attempts of one failing event before it is dead-lettered (``exhausted``).
    outbox_max_attempts: Setting[int] = Setting(10, int)
    #: Base and cap (seconds) of the relay's capped exponential backoff, full jitter.
    outbox_backoff_base: Setting[float] = Setting(0.5, float)
    outbox_backoff_cap: Setting[float] = Setting(30.0, float)
    #: Seconds after its publish with no trace of a worker receiving it (no attempt,
    #: ledger row, dead letter or lease) and its queue past it, before the relay
    #: publishes an event again (``django_outbox.reconcile``); 0 is off.
    outbox_reconcile_after: Setting[float] = Setting(300.0, float)
    #: Publishes again of one event before it is dead-lettered (``not_received``).
    outbox_reconcile_limit: Setting[int] = Setting(3, int)
    #: Events older than this (seconds since their publish) are not looked at: the
    #: attempt trail they would be checked against may have been pruned.
    outbox_reconcile_horizon: Setting[float] = Setting(86400.0, float)

    #: RabbitMQ's management API, for the dashboard's oldest-message age (AMQP cannot
    #: look at a message without taking it). Unset: the broker's host, port 15672 and
    #: credentials; "off": not read.
    rabbitmq_management_url: Setting[str] = Setting("", str)

    #: *environment* The port a worker serves its pool's metrics on (all interfaces;
    #: 0: off). Also read from the environment: two workers on one host need two ports.
    worker_metrics_port: Setting[int] = Setting(0, int, env=True)
    #: *environment* The worker's prometheus_client multiprocess directory, emptied at
    #: worker start; one per worker. Unset: ``<tmp>/celery-explicit-metrics-<port>``.
    metrics_dir: Setting[str] = Setting("", str, env=True)
    #: RabbitMQ's ``consumer_timeout`` in seconds (its default, 30 min): a delivery held
    #: longer has its channel closed. AMQP cannot read it; set it to what your
    #: rabbitmq.conf says (``manage.py check``: django_outbox.W011); 0 turns the check off.
    rabbitmq_consumer_timeout: Setting[float] = Setting(1800.0, float)
    #: The bearer token of the Django metrics view (database and broker gauges); unset:
    #: the view answers 404.
    #: *environment* Port where ``manage.py outbox_relay`` serves its own metrics (the
    #: relay is one process: no multiprocess directory); 0 is off.
    relay_metrics_port: Setting[int] = Setting(0, int, env=True)
    metrics_token: Setting[str] = Setting("", str)

    #: Retention, seconds (``manage.py explicit_prune``; docs/howto/small-state.md).
    #: Attempt rows older than this are deleted.
    retain_attempts: Setting[float] = Setting(30 * 86400.0, float)
    #: ``Fence`` rows (takeovers of running jobs) older than this are deleted.
    retain_fences: Setting[float] = Setting(30 * 86400.0, float)
    #: Dead letters resolved (replayed or discarded) longer ago than this are deleted;
    #: an open dead letter is never pruned.
    retain_dead_letters: Setting[float] = Setting(90 * 86400.0, float)
    #: Outbox events published (and past reconciliation) longer ago than this.
    retain_outbox: Setting[float] = Setting(7 * 86400.0, float)
    #: Effect-ledger rows older than this; never shorter than the floor ``manage.py
    #: check`` computes (the longest time a copy of a job can still arrive).
    retain_ledger: Setting[float] = Setting(30 * 86400.0, float)

    #: The interface a worker's metrics port listens on (``worker_metrics_port``);
    #: "0.0.0.0" opens it to the network (then set ``EXPLICIT_METRICS_TOKEN``).
    worker_metrics_bind: Setting[str] = Setting("127.0.0.1", str, env=True)

    #: The request header ``CorrelationMiddleware`` takes a web request's id from.
    correlation_header: Setting[str] = Setting("X-Request-ID", str)

    @property
    def redis_url(self) -> str:
        """``EXPLICIT_REDIS_URL``, or the broker when it is Redis."""
        if self.redis_url_setting:
            return self.redis_url_setting
        broker = str(self.celery_app().conf.broker_url or "")
        return (
            broker if broker.startswith(("redis://", "rediss://")) else "redis://127.0.0.1:6379/0"
        )

    def celery_app(self) -> Celery:
        if self.celery_app_path:
            app: Celery = import_string(self.celery_app_path)
            return app
        from celery import current_app

        return current_app._get_current_object()  # type: ignore[attr-defined,no-any-return]


# ``EXPLICIT_REDIS_URL`` and ``EXPLICIT_CELERY_APP`` keep their documented names.
Settings.redis_url_setting.name = PREFIX + "REDIS_URL"
Settings.celery_app_path.name = PREFIX + "CELERY_APP"

settings = Settings()
