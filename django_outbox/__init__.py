"""django_outbox: the database side of celery-explicit.

The ledger, the attempts, the dead letters and the transactional
outbox live here, with their admin, system checks and migrations. Add
``"django_outbox"`` to ``INSTALLED_APPS``.

Public API, by topic:

- publishing jobs and events: ``dispatch`` (after commit, or ``durable=True`` through
  the outbox), ``publish_event`` (a domain event, through the outbox), ``Relay`` (what
  ``manage.py explicit_relay`` runs)
- guarded writes: ``fenced_update``, ``versioned_update``
- caching: ``VersionedCache``, ``CacheAside``, with ``CacheStats`` and ``Verification``
- errors: ``OutboxError`` (root), ``CacheKeyError``, ``CacheConfigError``
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The errors import nothing of Django's models: safe to import at once.
from django_outbox.errors import CacheConfigError, CacheKeyError, OutboxError

if TYPE_CHECKING:
    from django_outbox.cache.versioned import CacheAside, CacheStats, Verification, VersionedCache
    from django_outbox.outbox.dispatch import dispatch
    from django_outbox.outbox.events import publish_event
    from django_outbox.outbox.relay.loop import Relay
    from django_outbox.store.guarded_writes import fenced_update, versioned_update

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
    "dispatch": "django_outbox.outbox.dispatch",
    "publish_event": "django_outbox.outbox.events",
    "Relay": "django_outbox.outbox.relay.loop",
    "fenced_update": "django_outbox.store.guarded_writes",
    "versioned_update": "django_outbox.store.guarded_writes",
    "VersionedCache": "django_outbox.cache.versioned",
    "CacheAside": "django_outbox.cache.versioned",
    "CacheStats": "django_outbox.cache.versioned",
    "Verification": "django_outbox.cache.versioned",
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
