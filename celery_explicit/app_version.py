"""Which version of the code ran a job: stamped on its attempt, dead letter and ledger entry.

"Did the deploy at 02:50 cause this?" is one filter when every row says which code wrote
it. The version is read once per process (a worker's code does not change while it
runs), from the first of:

1. ``EXPLICIT_APP_VERSION``, the Django setting or the environment variable;
2. an environment variable a deploy already sets: ``APP_VERSION``, ``GIT_COMMIT``,
   ``GIT_SHA``, ``SOURCE_VERSION`` (Heroku's build), ``HEROKU_RELEASE_VERSION``,
   ``K_REVISION`` (Cloud Run), ``RELEASE``;
3. the version of the installed distribution that holds the project's
   ``ROOT_URLCONF`` package (a project installed with pip);
4. ``""``: unknown, said as such.

A value longer than 64 characters or with spaces or control characters is refused by
``manage.py check`` (``django_outbox.E006``) when set as ``EXPLICIT_APP_VERSION``; one
read from the environment or a distribution is cut to 64 characters at the first
space, so a stray value never fails a job.

Cost: nothing on the job path beyond the column itself; the attempt row, the dead
letter and the ledger entry are written anyway.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re

from celery_explicit.conf import settings

__all__ = ["ENVIRONMENT", "current", "source"]

#: Environment variables a deploy commonly sets to its version, looked at in order.
ENVIRONMENT = (
    "APP_VERSION",
    "GIT_COMMIT",
    "GIT_SHA",
    "SOURCE_VERSION",
    "HEROKU_RELEASE_VERSION",
    "K_REVISION",
    "RELEASE",
)


@functools.cache
def current() -> str:
    """This process's code version ("" when nothing says it)."""
    return source()[0]


def source() -> tuple[str, str]:
    """The version and where it was read (for ``explicit_explain --version`` and the
    logs): ``("1.4.2", "EXPLICIT_APP_VERSION")``, ``("", "unknown")``."""
    # Checked by manage.py check (E006); cleaned all the same, so a process that runs
    # despite the check never writes a value its 64-character columns refuse.
    configured = _clean(settings.app_version)
    if configured:
        return configured, "EXPLICIT_APP_VERSION"
    for name in ENVIRONMENT:
        value = _clean(os.environ.get(name, ""))
        if value:
            return value, f"${name}"
    distribution = _distribution_version()
    if distribution:
        return distribution
    return "", "unknown"


def _distribution_version() -> tuple[str, str] | None:
    from django.conf import settings as django_settings

    urlconf = str(getattr(django_settings, "ROOT_URLCONF", "") or "")
    package = urlconf.split(".", 1)[0]
    if not package:
        return None
    for name in importlib.metadata.packages_distributions().get(package, []):
        try:
            version = _clean(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue
        if version:
            return version, f"distribution {name}"
    return None


def _clean(value: str) -> str:
    """The first word of ``value``, printable ASCII only, at most 64 characters."""
    word = value.strip().split(" ", 1)[0] if value.strip() else ""
    return re.sub(r"[^\x21-\x7e]", "", word)[:64]
