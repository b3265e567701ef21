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

import difflib
import ipaddress
import math
import os
import re
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, overload

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

if TYPE_CHECKING:
    from celery import Celery

T = TypeVar("T")
PREFIX = "EXPLICIT_"
_MISSING = object()

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _flag(value: Any) -> bool:
    """A switch: a bool, a number, or a word; a word we do not know is refused rather
    than read as on (``"of"`` for ``"off"`` must not leave a mechanism on unnoticed)."""
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise ValueError(f"{value!r} is not one of {', '.join(_TRUE + _FALSE[:-1])}")
    return bool(value)


def _int(value: Any) -> int:
    """A whole number; ``int()`` alone would read ``2.5`` as 2 and ``True`` as 1."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise TypeError(f"{value!r} is not a whole number")
    return int(value)


def _float(value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is not a number")
    return float(value)


def _text(value: Any) -> str:
    """A string; ``str()`` would turn a list or a number into a name nobody meant."""
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is a {type(value).__name__}, not a string")
    return value


#: What each cast reads, for the check's message ("cannot be read as a whole number").
_CAST_NAMES: dict[Callable[[Any], Any], str] = {
    _flag: "a switch (True/False)",
    _int: "a whole number",
    _float: "a number",
    _text: "a string",
}

_OPERATORS: dict[str, tuple[Callable[[float, float], bool], str]] = {
    "<": (lambda a, b: a < b, "less than"),
    "<=": (lambda a, b: a <= b, "at most"),
    ">": (lambda a, b: a > b, "greater than"),
    ">=": (lambda a, b: a >= b, "at least"),
}


@dataclass(frozen=True)
class Relation:
    """This setting compared with another (``other`` is its attribute name): the
    setting must be ``op`` the other. ``while_other_on``: only while the other is
    not 0 (0 turns that mechanism off, and then the relation says nothing)."""

    op: Literal["<", "<=", ">", ">="]
    other: str
    why: str
    while_other_on: bool = False


@dataclass(frozen=True)
class Problem:
    """A setting ``manage.py check`` refuses (``django_outbox.checks.check_settings``).

    ``kind``: ``cast`` (the value is not of the setting's type), ``rule`` (its range,
    choices or form) or ``relation`` (against another setting)."""

    setting: str
    value: Any
    kind: Literal["cast", "rule", "relation"]
    rule: str
    hint: str

    @property
    def message(self) -> str:
        return f"{self.setting}={self.value!r} {self.rule}"


class Setting(Generic[T]):
    """``EXPLICIT_<NAME>``, cast to ``T``; ``env=True`` also reads the environment.

    The rest is the setting's rule, which ``manage.py check`` applies
    (``Settings.problems()``): ``at_least``/``above``/``at_most`` for numbers (which
    must also be finite), ``choices``, ``check`` (a callable returning what is wrong
    with a value, or None) and ``relations`` to other settings. ``shown``: the default
    as docs/reference.md shows it, when ``repr`` would not say it (a test compares
    the two)."""

    def __init__(
        self,
        default: T,
        cast: Callable[[Any], T],
        *,
        env: bool = False,
        at_least: float | None = None,
        above: float | None = None,
        at_most: float | None = None,
        choices: Sequence[T] = (),
        check: Callable[[T], str | None] | None = None,
        relations: Sequence[Relation] = (),
        shown: str = "",
    ) -> None:
        self.default, self.cast, self.env = default, cast, env
        self.at_least, self.above, self.at_most = at_least, above, at_most
        self.choices, self.check, self.relations = tuple(choices), check, tuple(relations)
        self.shown = shown or (
            f'"{default}"' if isinstance(default, str) else repr(default)  # "x", not 'x'
        )
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
        value = self.configured()
        try:
            result = self.default if value is _MISSING or value is None else self.cast(value)
        except (TypeError, ValueError) as exc:
            raise ImproperlyConfigured(
                f"{self.name}={value!r} cannot be read as {_CAST_NAMES.get(self.cast)}: "
                f"{exc} (manage.py check says so too)"
            ) from exc
        if django_settings.configured and not self.env:
            # Kept on the instance, which then answers without this method: a job reads
            # a dozen settings, and a Django setting that is not set costs an
            # AttributeError each time. ``setting_changed`` (override_settings, the
            # test ``settings`` fixture) empties it. Switches that an environment
            # variable may turn are read every time.
            obj.__dict__[self.attribute] = result
        return result

    def configured(self) -> Any:
        """The value as given (Django setting, else environment), or ``_MISSING``."""
        # A process without Django settings (a bench, a one-off script) gets defaults.
        value = _MISSING
        if django_settings.configured:
            value = getattr(django_settings, self.name, _MISSING)
        if value is _MISSING and self.env:
            value = os.environ.get(self.name, _MISSING)
        return value

    def problems(self, value: Any) -> list[Problem]:
        """What is wrong with ``value`` (as configured) by this setting's own rule."""
        try:
            cast = self.cast(value)
        except (TypeError, ValueError) as exc:
            return [
                self._problem(
                    value,
                    "cast",
                    f"cannot be read as {_CAST_NAMES.get(self.cast, 'its type')}: {exc}",
                )
            ]
        found: list[str] = []
        if isinstance(cast, float) and not math.isfinite(cast):
            found.append("must be a finite number")
        elif isinstance(cast, int | float) and not isinstance(cast, bool):
            if self.at_least is not None and cast < self.at_least:
                found.append(f"must be at least {self.at_least:g}")
            if self.above is not None and cast <= self.above:
                found.append(f"must be greater than {self.above:g}")
            if self.at_most is not None and cast > self.at_most:
                found.append(f"must be at most {self.at_most:g}")
        if self.choices and cast not in self.choices:
            found.append(f"must be one of {', '.join(repr(c) for c in self.choices)}")
        if self.check is not None and (wrong := self.check(cast)):
            found.append(wrong)
        return [self._problem(value, "rule", rule) for rule in found]

    def _problem(self, value: Any, kind: Literal["cast", "rule", "relation"], rule: str) -> Problem:
        expected = self.describe()
        if kind == "rule" and self.check is not None and rule.startswith("must be "):
            expected += " that is " + rule.removeprefix("must be ")  # the check's own words
        hint = f"Set {self.name} to {expected}, or remove it for the default ({self.shown})."
        return Problem(setting=self.name, value=value, kind=kind, rule=rule, hint=hint)

    def describe(self) -> str:
        """The rule in words, for a hint: "a whole number, at least 1"."""
        words = [_CAST_NAMES.get(self.cast, "a value")]
        if self.at_least is not None:
            words.append(f"at least {self.at_least:g}")
        if self.above is not None:
            words.append(f"greater than {self.above:g}")
        if self.at_most is not None:
            words.append(f"at most {self.at_most:g}")
        if self.choices:
            words.append(f"one of {', '.join(repr(c) for c in self.choices)}")
        return ", ".join(words)


def _interface(value: str) -> str | None:
    """An interface to listen on: an IP address or a host name."""
    try:
        ipaddress.ip_address(value)
        return None
    except ValueError:
        pass
    label = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
    if len(value) <= 253 and re.fullmatch(rf"{label}(\.{label})*\.?", value):
        return None
    return 'must be an IP address or a host name ("0.0.0.0" listens on every interface)'


def _redis_url(value: str) -> str | None:
    # redis-py's from_url() knows these schemes; "" means the broker or the default.
    if value and urllib.parse.urlsplit(value).scheme not in ("redis", "rediss", "unix"):
        return "must be a redis://, rediss:// or unix:// URL"
    return None


def _management_url(value: str) -> str | None:
    if value and value.lower() != "off":
        parts = urllib.parse.urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return 'must be an http:// or https:// URL, "off", or empty'
    return None


def _notify_channel(value: str) -> str | None:
    # pg_notify() refuses a channel name past 63 bytes: every outbox write would then
    # fail inside its business transaction.
    return "must be at most 63 bytes" if len(value.encode()) > 63 else None


def _database_alias(value: str) -> str | None:
    aliases = list(getattr(django_settings, "DATABASES", {}) or {})
    if django_settings.configured and value not in aliases:
        return f"must be one of the DATABASES aliases ({', '.join(map(repr, aliases))})"
    return None


def _header_name(value: str) -> str | None:
    # RFC 9110 token characters: anything else is no header a request can carry.
    if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", value):
        return "must be an HTTP header name"
    return None


def _forget(**_: Any) -> None:
    """``setting_changed``: read every setting again."""
    settings.__dict__.clear()


setting_changed.connect(_forget, dispatch_uid="celery_explicit.conf")


class Settings:
    #: Dotted path of the Celery app (``"shop.celery.app"``); unset: Celery's current app.
    celery_app_path: Setting[str] = Setting("", _text)
    #: The alias holding the ledger, attempts and dead letters: the database your
    #: effects write to (the ledger row and the effect commit in one transaction).
    database: Setting[str] = Setting("default", _text, check=_database_alias)
    #: The Redis holding leases, locks, dedup marks, ordering and downstream state;
    #: unset: the Celery broker when it is Redis, else redis://127.0.0.1:6379/0.
    redis_url_setting: Setting[str] = Setting("", _text, check=_redis_url)
    #: Prefix of every Redis key we write (an operator finds them all under it).
    key_prefix: Setting[str] = Setting("explicit:", _text)
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
    database_outage_backoff_cap: Setting[float] = Setting(30.0, _float, above=0)
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
    outbox_batch_size: Setting[int] = Setting(100, _int, at_least=1)
    #: PostgreSQL + psycopg 3: the relay's claim rides with BEGIN and its marks with
    #: COMMIT (three round trips a batch, not five). Off: every statement through
    #: Django's cursor.
    outbox_relay_round_trips: Setting[bool] = Setting(True, _flag)
    #: Seconds an idle relay waits before looking again (with LISTEN/NOTIFY a commit
    #: wakes it at once; without, this is the publish lag).
    outbox_poll_interval: Setting[float] = Setting(1.0, _float, above=0)
    #: The PostgreSQL channel writers NOTIFY and the relay LISTENs on; "" polls.
    outbox_notify_channel: Setting[str] = Setting("explicit_outbox", _text, check=_notify_channel)
    #: Publish attempts of one failing event before it is dead-lettered (``exhausted``).
    outbox_max_attempts: Setting[int] = Setting(10, _int, at_least=1)
    #: Base and cap (seconds) of the relay's capped exponential backoff, full jitter.
    outbox_backoff_base: Setting[float] = Setting(0.5, _float, above=0)
    outbox_backoff_cap: Setting[float] = Setting(
        30.0,
        _float,
        above=0,
        relations=[Relation(">=", "outbox_backoff_base", "the cap bounds the base's growth")],
    )
    #: Seconds after its publish with no trace of a worker receiving it (no attempt,
    #: ledger row, dead letter or lease) and its queue past it, before the relay
    #: publishes an event again (``django_outbox.outbox.relay.reconcile``); 0 is off.
    outbox_reconcile_after: Setting[float] = Setting(300.0, _float, at_least=0)
    #: Publishes again of one event before it is dead-lettered (``not_received``).
    outbox_reconcile_limit: Setting[int] = Setting(3, _int, at_least=0)
    #: Events older than this (seconds since their publish) are not looked at: the
    #: attempt trail they would be checked against may have been pruned.
    outbox_reconcile_horizon: Setting[float] = Setting(
        86400.0,
        _float,
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
    rabbitmq_management_url: Setting[str] = Setting("", _text, check=_management_url)

    #: *environment* The port a worker serves its pool's metrics on (``worker_metrics_bind``;
    #: 0: off). Also read from the environment: two workers on one host need two ports.
    worker_metrics_port: Setting[int] = Setting(0, _int, env=True, at_least=0, at_most=65535)
    #: *environment* The worker's prometheus_client multiprocess directory, emptied at
    #: worker start; one per worker. Unset: ``<tmp>/celery-explicit-metrics-<port>``.
    metrics_dir: Setting[str] = Setting("", _text, env=True)
    #: RabbitMQ's ``consumer_timeout`` in seconds (its default, 30 min): a delivery held
    #: longer has its channel closed. AMQP cannot read it; set it to what your
    #: rabbitmq.conf says (``manage.py check``: django_outbox.W011); 0 turns the check off.
    rabbitmq_consumer_timeout: Setting[float] = Setting(1800.0, _float, at_least=0)
    #: *environment* Port where ``manage.py explicit_relay`` serves its own metrics (the
    #: relay is one process: no multiprocess directory); 0 is off.
    relay_metrics_port: Setting[int] = Setting(0, _int, env=True, at_least=0, at_most=65535)
    #: The bearer token of the Django metrics view (database and broker gauges); unset:
    #: the view answers 404.
    metrics_token: Setting[str] = Setting("", _text)

    #: Retention, seconds (``manage.py explicit_prune``; docs/howto/small-state.md).
    #: Attempt rows older than this are deleted.
    retain_attempts: Setting[float] = Setting(30 * 86400.0, _float, above=0)
    #: ``Fence`` rows (takeovers of running jobs) older than this are deleted.
    retain_fences: Setting[float] = Setting(30 * 86400.0, _float, above=0)
    #: Dead letters resolved (replayed or discarded) longer ago than this are deleted;
    #: an open dead letter is never pruned.
    retain_dead_letters: Setting[float] = Setting(90 * 86400.0, _float, above=0)
    #: Outbox events published (and past reconciliation) longer ago than this.
    retain_outbox: Setting[float] = Setting(7 * 86400.0, _float, above=0)
    #: Effect-ledger rows older than this; never shorter than the floor ``manage.py
    #: check`` computes (the longest time a copy of a job can still arrive).
    retain_ledger: Setting[float] = Setting(30 * 86400.0, _float, above=0)

    #: The interface the worker's and the relay's metrics ports listen on;
    #: "0.0.0.0" opens it to the network (then set ``EXPLICIT_METRICS_TOKEN``).
    worker_metrics_bind: Setting[str] = Setting("127.0.0.1", _text, env=True, check=_interface)

    #: The request header ``CorrelationMiddleware`` takes a web request's id from.
    correlation_header: Setting[str] = Setting("X-Request-ID", _text, check=_header_name)

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
            value = setting.default if value is _MISSING or value is None else value
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
                holds, words = _OPERATORS[relation.op]
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
