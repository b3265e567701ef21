"""What every check of ours reads first: the settings, guarded, and the app's tasks.

A check reads our settings only when each of them can be read as its type
(``reads_settings``), and judges the ExplicitTasks with their task modules imported
(``loaded_tasks``): the retention checks read both the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from django.core import checks

from celery_explicit import bootsteps
from django_outbox.conf import settings

__all__ = ["Check", "explicit_tasks", "loaded_tasks", "reads_settings"]

Check = Callable[..., list[checks.CheckMessage]]


def reads_settings(check: Check) -> Check:
    """A check that reads our settings says nothing while one of them cannot be read
    as its type: ``check_settings`` reports that one (E007), where reading it here
    would end ``manage.py check`` in a traceback. Every check of ours that reads a
    setting wears it, under ``@checks.register``."""

    @functools.wraps(check)
    def guarded(*args: Any, **kwargs: Any) -> list[checks.CheckMessage]:
        if any(problem.kind == "cast" for problem in settings.problems()):
            return []
        return check(*args, **kwargs)

    return guarded


def loaded_tasks(app: Any) -> list[Any]:
    """Every ExplicitTask of ``app``, its task modules imported; ``ContractError`` for
    the first that does not load.

    Decorator-declared tasks are lazy until the app finalizes; forced here so a
    contract error surfaces in the check, not when the task is first used. (Celery's
    own import_default_modules would run django.setup() again from inside a check;
    importing each installed app's tasks module is what its Django autodiscovery
    does.)
    """
    bootsteps.import_tasks(app)  # each module once: a refused one is not run again
    return explicit_tasks(app)


def explicit_tasks(app: Any) -> list[Any]:
    """The ExplicitTasks ``app`` has registered so far (nothing imported)."""
    from celery_explicit.task import ExplicitTask

    return [t for t in app.tasks.values() if isinstance(t, ExplicitTask)]
