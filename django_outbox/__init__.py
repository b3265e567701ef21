"""django_outbox: the database side of celery-explicit.

The effect ledger, the attempt audit trail, the dead letters and the transactional
outbox live here, with their admin, system checks and migrations. Add
``"django_outbox"`` to ``INSTALLED_APPS``.

Public API, by topic:

- publishing jobs and events: ``dispatch`` (after commit, or ``durable=True`` through
  the outbox), ``publish_event`` (a domain event, through the outbox), ``Relay`` (what
  ``manage.py outbox_relay`` runs)
- guarded writes: ``fenced_update``, ``versioned_update``
- caching: ``VersionedCache``, ``CacheAside``, with ``CacheStats`` and ``Verification``
- errors: ``OutboxError`` (root), ``CacheKeyError``, ``CacheConfigError``
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

# The errors import nothing of Django's models: safe to import at once.
from django_outbox.errors import CacheConfigError, CacheKeyError, OutboxError

if TYPE_CHECKING:
    from django_outbox.cache import CacheAside, CacheStats, Verification, VersionedCache
    from django_outbox.dispatch import dispatch
    from django_outbox.fencing import fenced_update, versioned_update
    from django_outbox.outbox import publish_event
    from django_outbox.relay import Relay

__all__ = [
    # publishing jobs and events
    "dispatch",
    "publish_event",
    "Relay",
    # guarded writes
    "fenced_update",
    "versioned_update",
    # caching
    "VersionedCache",
    "CacheAside",
    "CacheStats",
    "Verification",
    # errors
    "OutboxError",
    "CacheKeyError",
    "CacheConfigError",
]

# Django imports this package (it is in INSTALLED_APPS) before the app registry is
# ready, and several of these modules import the models: a model imported then raises
# AppRegistryNotReady. So each name is imported on first use (PEP 562), not here.
_LAZY = {
    "publish_event": "django_outbox.outbox",
    "Relay": "django_outbox.relay",
    "fenced_update": "django_outbox.fencing",
    "versioned_update": "django_outbox.fencing",
    "VersionedCache": "django_outbox.cache",
    "CacheAside": "django_outbox.cache",
    "CacheStats": "django_outbox.cache",
    "Verification": "django_outbox.cache",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once: later reads do not come back here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """This package, with ``dispatch`` kept the function.

    The function shares its name with its module, ``django_outbox.dispatch``, and the
    import system sets every submodule it loads on its package: the first import of
    the module would replace the function by the module (a lazy name is looked up
    after its module is loaded, the reverse of an eager ``from ... import``). A data
    descriptor on the module's class wins over that assignment.
    """

    @property
    def dispatch(self) -> Any:
        return importlib.import_module("django_outbox.dispatch").dispatch

    @dispatch.setter
    def dispatch(self, value: object) -> None:
        if not isinstance(value, types.ModuleType):
            raise AttributeError("django_outbox.dispatch cannot be replaced")
        # The import system announcing the submodule: the name stays the function's.


sys.modules[__name__].__class__ = _Package
