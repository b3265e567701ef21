"""Exceptions of django_outbox, under one root.

``OutboxError`` sits under celery_explicit's ``ExplicitError``, so ``except
ExplicitError`` still catches everything the project raises, and ``except OutboxError``
only what this app raises.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

from celery_explicit.errors import ExplicitError

__all__ = ["OutboxError", "CacheKeyError", "CacheConfigError"]


class OutboxError(ExplicitError):
    """Root of every exception raised by django_outbox: do not raise directly; catch it
    to catch every error of this app."""


# --- the cache (django_outbox.cache.versioned) ---------------------------------------------------


class CacheKeyError(OutboxError, ValueError):
    """The fields or version given to a cache do not fit its key template: fix the caller.

    Carries ``cache_name`` and ``field`` (``"version"`` for a bad version).
    """

    def __init__(self, cache_name: str, field: str | None, message: str) -> None:
        self.cache_name = cache_name
        self.field = field
        super().__init__(f"Cache {cache_name}: {message}")


class CacheConfigError(OutboxError, ImproperlyConfigured):
    """A cache declared with a bad template or option, or over a backend that is not
    django-redis. Carries ``cache_name`` and ``field`` (the template field or option)."""

    def __init__(self, cache_name: str, field: str | None, message: str) -> None:
        self.cache_name = cache_name
        self.field = field
        super().__init__(f"Cache {cache_name}: {message}")
