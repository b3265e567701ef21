"""The configuration checks: our settings, the ledger's database, the installed versions.

- E006 a setting (``EXPLICIT_*``) outside its rule: a range, its choices, its form
- E007 a setting that cannot be read as its type (``"abc"`` for a number)
- E008 a setting against another (a reconcile horizon at or below ``AFTER``, a backoff
  cap below its base)
- W013 an ``EXPLICIT_*`` Django setting that no setting reads (a misspelling), with the
  names it is close to
- E005 the ledger's database cannot do ``INSERT ... ON CONFLICT DO NOTHING RETURNING``
- W005 the installed Celery or kombu is outside the tested ranges: a worker refuses to
  start, or starts only because ``EXPLICIT_ALLOW_UNTESTED_VERSIONS`` overrides it

``check_settings`` is the one check that reads every setting unguarded: it is the one
that reports a setting that cannot be read (``reading.reads_settings``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.core import checks
from django.db import connections

from celery_explicit import versions
from django_outbox.checks.reading import reads_settings
from django_outbox.conf import settings

__all__ = ["SETTING_CHECK_IDS", "check_ledger_database", "check_settings", "check_versions"]

#: ``Problem.kind`` -> the check id that reports it.
SETTING_CHECK_IDS = {
    "rule": "django_outbox.E006",
    "cast": "django_outbox.E007",
    "relation": "django_outbox.E008",
}


@checks.register("django_outbox")
def check_settings(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """E006/E007/E008: a setting against its rule, its type, or another setting (the
    table is ``celery_explicit.conf.Settings``); W013: an ``EXPLICIT_*`` Django setting
    no setting reads, which would otherwise do nothing at all."""
    found: list[checks.CheckMessage] = [
        checks.Error(
            problem.message,
            hint=problem.hint,
            obj=problem.setting,
            id=SETTING_CHECK_IDS[problem.kind],
        )
        for problem in settings.problems()
    ]
    for name, close in settings.unknown().items():
        found.append(
            checks.Warning(
                f"{name} is set, but no celery-explicit setting has that name: it does nothing",
                hint=(
                    f"Did you mean {' or '.join(close)}?"
                    if close
                    else "The settings are listed in docs/reference.md (Settings)."
                ),
                obj=name,
                id="django_outbox.W013",
            )
        )
    return found


@checks.register("django_outbox")
@reads_settings
def check_versions(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """W005: Celery or kombu outside the tested ranges (``celery_explicit.versions``).

    A warning, not an error: the worker refuses to start by itself
    (``bootsteps.refuse_untested_versions``); with the override set, this is where
    the override stays visible."""
    line = versions.untested_line(versions.installed())
    if line is None:
        return []
    if settings.allow_untested_versions:
        return [
            checks.Warning(
                f"{line}; workers start anyway because EXPLICIT_ALLOW_UNTESTED_VERSIONS is set",
                hint="Install versions in the tested ranges (docs/compatibility.md), then "
                "remove EXPLICIT_ALLOW_UNTESTED_VERSIONS.",
                id="django_outbox.W005",
            )
        ]
    return [
        checks.Warning(
            f"{line}; a worker will refuse to start",
            hint="Install versions in the tested ranges (docs/compatibility.md), or set "
            "EXPLICIT_ALLOW_UNTESTED_VERSIONS = True to start workers anyway.",
            id="django_outbox.W005",
        )
    ]


@checks.register("django_outbox", checks.Tags.database)
@reads_settings
def check_ledger_database(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    if settings.database not in connections:
        return []  # check_settings names the alias (E006)
    connection = connections[settings.database]
    if connection.vendor in ("postgresql", "sqlite"):
        return []
    return [
        checks.Error(
            f"the ledger needs INSERT ... ON CONFLICT DO NOTHING RETURNING, which "
            f"database {settings.database!r} ({connection.vendor}) does not offer",
            hint="Use PostgreSQL (or SQLite for a demo) for EXPLICIT_DATABASE.",
            id="django_outbox.E005",
        )
    ]
