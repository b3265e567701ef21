"""django-celery-beat's ``DatabaseScheduler``, publishing each entry once per slot.

Entries live in the database (``django_celery_beat.PeriodicTask``), so every beat
started on it runs all of them: two beats on one database publish every run twice.
This one claims each run's slot first (``celery_explicit.beat``)::

    celery -A proj beat -S celery_explicit.beat_database:DatabaseScheduler

Needs ``django-celery-beat`` (``pip install celery-explicit[beat]``); importing it
imports django-celery-beat's models, so Django must be set up (Celery's Django fix-up
does it before beat loads its scheduler).
"""

from __future__ import annotations

from django_celery_beat.schedulers import DatabaseScheduler as _DatabaseScheduler

from celery_explicit.beat import SlotClaims

__all__ = ["DatabaseScheduler"]


class DatabaseScheduler(SlotClaims, _DatabaseScheduler):  # type: ignore[misc]
    """django-celery-beat's scheduler, publishing each entry once per slot across beats."""
