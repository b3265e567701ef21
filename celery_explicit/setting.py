"""One setting: how it is read, cast and checked (``celery_explicit.conf`` is the table).

A ``Setting`` is a descriptor on the table ``celery_explicit.conf.Settings``: reading
it reads the Django setting ``EXPLICIT_<NAME>`` (and, for a switch marked *environment*,
the environment variable of the same name) and casts it; but for those switches, the
result is kept until a Django setting changes. The casts refuse what ``int()`` or
``str()`` would quietly turn into something nobody meant (``2.5`` read as 2, ``"of"``
read as on, a list as a name).

A setting also carries its rule: a range, choices, a check (one of the ``*_rule``
functions here, answering what is wrong with a value) and relations to other settings.
``manage.py check`` applies them through ``Settings.problems()``, each failure a
``Problem`` with a hint that names the setting, the rule and the default.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, overload

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured

T = TypeVar("T")
PREFIX = "EXPLICIT_"
MISSING = object()

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def flag(value: Any) -> bool:
    """A switch: a bool, a number, or a word; a word we do not know is refused rather
    than read as on (``"of"`` for ``"off"`` must not leave a mechanism on unnoticed)."""
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise ValueError(f"{value!r} is not one of {', '.join(_TRUE + _FALSE[:-1])}")
    return bool(value)


def whole_number(value: Any) -> int:
    """A whole number; ``int()`` alone would read ``2.5`` as 2 and ``True`` as 1."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise TypeError(f"{value!r} is not a whole number")
    return int(value)


def number(value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is not a number")
    return float(value)


def text(value: Any) -> str:
    """A string; ``str()`` would turn a list or a number into a name nobody meant."""
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is a {type(value).__name__}, not a string")
    return value


#: What each cast reads, for the check's message ("cannot be read as a whole number").
CAST_NAMES: dict[Callable[[Any], Any], str] = {
    flag: "a switch (True/False)",
    whole_number: "a whole number",
    number: "a number",
    text: "a string",
}

OPERATORS: dict[str, tuple[Callable[[float, float], bool], str]] = {
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
            result = self.default if value is MISSING or value is None else self.cast(value)
        except (TypeError, ValueError) as exc:
            raise ImproperlyConfigured(
                f"{self.name}={value!r} cannot be read as {CAST_NAMES.get(self.cast)}: "
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
        """The value as given (Django setting, else environment), or ``MISSING``."""
        # A process without Django settings (a bench, a one-off script) gets defaults.
        value = MISSING
        if django_settings.configured:
            value = getattr(django_settings, self.name, MISSING)
        if value is MISSING and self.env:
            value = os.environ.get(self.name, MISSING)
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
                    f"cannot be read as {CAST_NAMES.get(self.cast, 'its type')}: {exc}",
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
        words = [CAST_NAMES.get(self.cast, "a value")]
        if self.at_least is not None:
            words.append(f"at least {self.at_least:g}")
        if self.above is not None:
            words.append(f"greater than {self.above:g}")
        if self.at_most is not None:
            words.append(f"at most {self.at_most:g}")
        if self.choices:
            words.append(f"one of {', '.join(repr(c) for c in self.choices)}")
        return ", ".join(words)


def interface_rule(value: str) -> str | None:
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


STATE_STORE_SCHEMES = ("redis", "rediss", "unix", "sentinel", "redis+cluster", "rediss+cluster")


def redis_url_rule(value: str) -> str | None:
    # redis-py's from_url() knows the first three; Celery's sentinel:// form and our
    # redis+cluster:// go to redis-py's Sentinel and cluster clients (redis_state); ""
    # means the broker or the default.
    scheme = urllib.parse.urlsplit(value).scheme
    if value and scheme not in STATE_STORE_SCHEMES:
        return "must be a redis://, rediss://, unix://, sentinel:// or redis+cluster:// URL"
    return None


def management_url_rule(value: str) -> str | None:
    if value and value.lower() != "off":
        parts = urllib.parse.urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return 'must be an http:// or https:// URL, "off", or empty'
    return None


def notify_channel_rule(value: str) -> str | None:
    # pg_notify() refuses a channel name past 63 bytes: every outbox write would then
    # fail inside its business transaction.
    return "must be at most 63 bytes" if len(value.encode()) > 63 else None


def database_alias_rule(value: str) -> str | None:
    aliases = list(getattr(django_settings, "DATABASES", {}) or {})
    if django_settings.configured and value not in aliases:
        return f"must be one of the DATABASES aliases ({', '.join(map(repr, aliases))})"
    return None


def app_version_rule(value: str) -> str | None:
    # Stored in a 64-character column and shown on one line of explain and the admin.
    if len(value) > 64:
        return f"must be at most 64 characters (it has {len(value)})"
    if value and not re.fullmatch(r"[\x21-\x7e]+", value):
        return "must be printable ASCII with no spaces (a tag, a commit, a build number)"
    return None


def header_name_rule(value: str) -> str | None:
    # RFC 9110 token characters: anything else is no header a request can carry.
    if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", value):
        return "must be an HTTP header name"
    return None
