"""The app's settings: the one settings object of celery-explicit (``EXPLICIT_*``).

Kept as a module so ``from django_outbox.conf import settings`` goes on working; the
object and the list of settings live in ``celery_explicit.conf``.
"""

from celery_explicit.conf import Settings, settings

__all__ = ["Settings", "settings"]
