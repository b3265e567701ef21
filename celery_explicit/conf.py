"""Every setting of celery-explicit, read lazily through one typed object.

Each attribute of ``settings`` is the Django setting ``EXPLICIT_<NAME>`` (e.g.
``settings.redis_url`` is ``EXPLICIT_REDIS_URL``). Read at call time, never at import
time or in a model field, so ``override_settings`` works and migrations never depend on
settings. The switches marked *environment* may also come from an environment variable
of the same name (a Django setting wins): they exist to turn a mechanism off on one
worker during an incident or a negative-control test, without a deploy. No other
module reads ``os.environ`` or ``django.conf.settings`` for our options.

This module is the table (``Settings``, one line a setting, with its comment) and the
object read everywhere (``settings``); how one setting is read, cast and checked is
``celery_explicit.setting``, the only other module that reads them.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any

from django.conf import settings as django_settings
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

from celery_explicit.setting import (
    MISSING,
    OPERATORS,
    PREFIX,
    Problem,
    Relation,
    Setting,
    app_version_rule,
    database_alias_rule,
    flag,
    header_name_rule,
    interface_rule,
    management_url_rule,
    notify_channel_rule,
    number,
    redis_url_rule,
    text,
    whole_number,
)

if TYPE_CHECKING:
    from celery import Celery


def _forget(**_: Any) -> None:
    """``setting_changed``: read every setting again."""
    settings.__dict__.clear()


setting_changed.connect(_forget, dispatch_uid="celery_explicit.conf")


class Settings:
    #: Dotted path of the Celery app (``"shop.celery.app"``); unset: Celery's current app.
    celery_app_path: Setting[str] = Setting("", text)
    #: The alias holding the ledger, attempts and dead letters: the database your
    #: effects write to (the ledger row and the effect commit in one transaction).
    database: Setting[str] = Setting("default", text, check=database_alias_rule)
    #: The Redis holding leases, locks, dedup marks, ordering and downstream state;
    #: unset: the Celery broker when it is Redis (or Sentinel), else redis://127.0.0.1:6379/0.
    redis_url_setting: Setting[str] = Setting("", text, check=redis_url_rule)
    #: Prefix of every Redis key we write (an operator finds them all under it).
    key_prefix: Setting[str] = Setting("explicit:", text)
    #: PostgreSQL + psycopg 3: the ledger's claim rides with BEGIN and its last writes
    #: with COMMIT (no extra round trips). Off: every statement through Django's cursor.
    ledger_round_trips: Setting[bool] = Setting(True, flag)
    #: *environment* Off: every delivery runs without an execution lease or a fence.
    execution_lease: Setting[bool] = Setting(True, flag, env=True)
    #: *environment* Off: message and execution leases are not extended (they run out).
    lease_extend: Setting[bool] = Setting(True, flag, env=True)
    #: *environment* Off: an effect is checked only under the key this worker renders,
    #: not under the key its message was published with nor the task's earlier key
    #: templates (``celery_explicit.key_history``; a negative-control switch).
    key_history: Setting[bool] = Setting(True, flag, env=True)
    #: *environment* Off: a worker in warm shutdown stops extending the leases of the
    #: jobs it is still draining (Celery's own behaviour: they run out mid-job).
    drain_heartbeat: Setting[bool] = Setting(True, flag, env=True)
    #: *environment* Off (Redis broker): an ack removes the broker's record of a
    #: delivery by its tag even when another worker holds that delivery now (kombu's
    #: own behaviour: a stale copy's ack drops the live copy's record).
    delivery_holder: Setting[bool] = Setting(True, flag, env=True)
    #: *environment* Off (Redis broker): kombu's ``BRPOP`` takes a message off its queue
    #: and the worker records it as delivered in a second command; a worker killed
    #: between the two loses it (kombu's own behaviour; a negative-control switch).
    atomic_fetch: Setting[bool] = Setting(True, flag, env=True)
    #: Seconds, the longest a job waits between two tries while the database cannot be
    #: written (``celery_explicit.database_outage``; backoff from 1 s, equal jitter).
    database_outage_backoff_cap: Setting[float] = Setting(30.0, number, above=0)
    #: *environment* Off: a database outage is classified by the task's retry policy
    #: like any other error (dead-lettered or retried within ``max_attempts``; a
    #: negative-control switch).
    database_outage: Setting[bool] = Setting(True, flag, env=True)
    #: *environment* Off (Redis broker): kombu's sweep compares the message leases'
    #: scores with the sweeping host's own clock, not the Redis server's (kombu's own
    #: behaviour; a negative-control switch).
    server_clock: Setting[bool] = Setting(True, flag, env=True)
    #: A worker refuses to start while ``manage.py check`` reports one of our errors
    #: (``django_outbox.E*``: a contract, the broker's backstop, pickle). True: it
    #: starts anyway and logs them as warnings (an escape hatch, not a default).
    start_despite_check_errors: Setting[bool] = Setting(False, flag)
    #: A worker refuses to start on a Celery or kombu outside the tested ranges
    #: (``celery_explicit.versions.TESTED``). True: it starts, logs one warning, and
    #: ``manage.py check`` reports ``django_outbox.W005`` (an override, not a default).
    allow_untested_versions: Setting[bool] = Setting(False, flag)
    #: Events one relay claims, publishes and marks in one transaction.
    outbox_batch_size: Setting[int] = Setting(100, whole_number, at_least=1)
    #: PostgreSQL + psycopg 3: the relay's claim rides with BEGIN and its marks with
    #: COMMIT (three round trips a batch, not five). Off: every statement through
    #: Django's cursor.
    outbox_relay_round_trips: Setting[bool] = Setting(True, flag)
    #: Redis broker: each outbox event's broker message is built when the event is
    #: written, in the writer's transaction, and stored on its row; the relay pushes
    #: those bytes instead of building each message (``django_outbox.outbox.prepared``).
    #: The relay publishes about three times as many events a second; the writer spends
    #: about twice the CPU an event. Off: the relay builds every message.
    outbox_prepared_messages: Setting[bool] = Setting(False, flag)
    #: Seconds an idle relay waits before looking again (with LISTEN/NOTIFY a commit
    #: wakes it at once; without, this is the publish lag).
    outbox_poll_interval: Setting[float] = Setting(1.0, number, above=0)
    #: The PostgreSQL channel writers NOTIFY and the relay LISTENs on; "" polls.
    outbox_notify_channel: Setting[str] = Setting(
        "explicit_outbox", text, check=notify_channel_rule
    )
    #: Publish attempts of one failing event before it is dead-lettered (``exhausted``).
    outbox_max_attempts: Setting[int] = Setting(10, whole_number, at_least=1)
    #: Base and cap (seconds) of the relay's capped exponential backoff, full jitter.
    outbox_backoff_base: Setting[float] = Setting(0.5, number, above=0)
    outbox_backoff_cap: Setting[float] = Setting(
        30.0,
        number,
        above=0,
        relations=[Relation(">=", "outbox_backoff_base", "the cap bounds the base's growth")],
    )
    #: Seconds after its publish with no trace of a worker receiving it (no attempt,
    #: ledger row, dead letter or lease) and its queue past it, before the relay
    #: publishes an event again (``django_outbox.outbox.relay.reconcile``); 0 is off.
    outbox_reconcile_after: Setting[float] = Setting(300.0, number, at_least=0)
    #: Publishes again of one event before it is dead-lettered (``not_received``).
    outbox_reconcile_limit: Setting[int] = Setting(3, whole_number, at_least=0)
    #: Events older than this (seconds since their publish) are not looked at: the
    #: attempt trail they would be checked against may have been pruned.
    outbox_reconcile_horizon: Setting[float] = Setting(
        86400.0,
        number,
        above=0,
        relations=[
            Relation(
                ">",
                "outbox_reconcile_after",
                "an event is looked at only between the two: a horizon at or below it "
                "turns reconciliation off",
                while_other_on=True,
            )
        ],
    )

    #: RabbitMQ's management API, for the dashboard's oldest-message age (AMQP cannot
    #: look at a message without taking it). Unset: the broker's host, port 15672 and
    #: credentials; "off": not read.
    rabbitmq_management_url: Setting[str] = Setting("", text, check=management_url_rule)

    #: *environment* The port a worker serves its pool's metrics on (``worker_metrics_bind``;
    #: 0: off). Also read from the environment: two workers on one host need two ports.
    worker_metrics_port: Setting[int] = Setting(
        0, whole_number, env=True, at_least=0, at_most=65535
    )
    #: *environment* The worker's prometheus_client multiprocess directory, emptied at
    #: worker start; one per worker. Unset: ``<tmp>/celery-explicit-metrics-<port>``.
    metrics_dir: Setting[str] = Setting("", text, env=True)
    #: RabbitMQ's ``consumer_timeout`` in seconds (its default, 30 min): a delivery held
    #: longer has its channel closed. AMQP cannot read it; set it to what your
    #: rabbitmq.conf says (``manage.py check``: django_outbox.W011); 0 turns the check off.
    rabbitmq_consumer_timeout: Setting[float] = Setting(1800.0, number, at_least=0)
    #: *environment* Port where ``manage.py explicit_relay`` serves its own metrics (the
    #: relay is one process: no multiprocess directory); 0 is off.
    relay_metrics_port: Setting[int] = Setting(0, whole_number, env=True, at_least=0, at_most=65535)
    #: The bearer token of the Django metrics view (database and broker gauges); unset:
    #: the view answers 404.
    metrics_token: Setting[str] = Setting("", text)

    #: Retention, seconds (``manage.py explicit_prune``; docs/howto/small-state.md).
    #: Attempt rows older than this are deleted.
    retain_attempts: Setting[float] = Setting(30 * 86400.0, number, above=0)
    #: ``Fence`` rows (takeovers of running jobs) older than this are deleted.
    retain_fences: Setting[float] = Setting(30 * 86400.0, number, above=0)
    #: Dead letters resolved (replayed or discarded) longer ago than this are deleted;
    #: an open dead letter is never pruned.
    retain_dead_letters: Setting[float] = Setting(90 * 86400.0, number, above=0)
    #: Outbox events published (and past reconciliation) longer ago than this.
    retain_outbox: Setting[float] = Setting(7 * 86400.0, number, above=0)
    #: Effect-ledger rows older than this; never shorter than the floor ``manage.py
    #: check`` computes (the longest time a copy of a job can still arrive).
    retain_ledger: Setting[float] = Setting(30 * 86400.0, number, above=0)
    #: A cancellation by key keeps later jobs of that key from running until pruned.
    retain_cancellations: Setting[float] = Setting(90 * 86400.0, number, above=0)

    #: The interface the worker's and the relay's metrics ports listen on;
    #: "0.0.0.0" opens it to the network (then set ``EXPLICIT_METRICS_TOKEN``).
    worker_metrics_bind: Setting[str] = Setting("127.0.0.1", text, env=True, check=interface_rule)

    #: The version of the code a worker runs, stamped on every attempt, dead letter and
    #: ledger entry (``celery_explicit.app_version``); "" looks it up.
    app_version: Setting[str] = Setting("", text, env=True, check=app_version_rule)

    #: The request header ``CorrelationMiddleware`` takes a web request's id from.
    correlation_header: Setting[str] = Setting("X-Request-ID", text, check=header_name_rule)

    @classmethod
    def table(cls) -> dict[str, Setting[Any]]:
        """Every setting, by its Django name (``EXPLICIT_...``)."""
        return {s.name: s for s in vars(cls).values() if isinstance(s, Setting)}

    def problems(self) -> list[Problem]:
        """Each setting's value (as configured, else its default) against its rule, then
        against its relations; ``manage.py check`` reports them
        (``django_outbox.checks.check_settings``)."""
        table = self.table()
        found: list[Problem] = []
        values: dict[str, Any] = {}  # attribute -> cast value, for those that obey
        for setting in table.values():
            value = setting.configured()
            value = setting.default if value is MISSING or value is None else value
            own = setting.problems(value)
            found += own
            if not own:
                values[setting.attribute] = setting.cast(value)
        by_attribute = {s.attribute: s for s in table.values()}
        for setting in table.values():
            for relation in setting.relations:
                other = by_attribute[relation.other]
                if setting.attribute not in values or other.attribute not in values:
                    continue  # one of the two is already wrong on its own
                mine, theirs = values[setting.attribute], values[other.attribute]
                if relation.while_other_on and not theirs:
                    continue
                holds, words = OPERATORS[relation.op]
                if holds(mine, theirs):
                    continue
                off = f", or set {other.name} = 0 to turn it off" if relation.while_other_on else ""
                found.append(
                    Problem(
                        setting=setting.name,
                        value=mine,
                        kind="relation",
                        rule=f"must be {words} {other.name}={theirs!r}: {relation.why}",
                        hint=f"Change {setting.name} or {other.name} so that "
                        f"{setting.name} {relation.op} {other.name}{off}.",
                    )
                )
        return found

    def unknown(self) -> dict[str, list[str]]:
        """Django settings named ``EXPLICIT_*`` that no setting reads (a misspelling does
        nothing at all otherwise), each with the known names it is close to."""
        if not django_settings.configured:
            return {}
        known = {name.removeprefix(PREFIX): name for name in self.table()}
        return {
            name: [
                known[close]
                for close in difflib.get_close_matches(name.removeprefix(PREFIX), list(known))
            ]
            for name in sorted(dir(django_settings))
            if name.startswith(PREFIX) and name.removeprefix(PREFIX) not in known
        }

    @property
    def redis_url(self) -> str:
        """``EXPLICIT_REDIS_URL``, or the broker when it is Redis."""
        if self.redis_url_setting:
            return self.redis_url_setting
        broker = str(self.celery_app().conf.broker_url or "")
        return (
            broker
            if broker.startswith(("redis://", "rediss://", "sentinel://"))
            else "redis://127.0.0.1:6379/0"
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
