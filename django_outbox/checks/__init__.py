"""System checks: what can only be judged with the whole configuration.

``manage.py check`` (and the worker, through Django's start-up) reports, by module:

- ``celery_app``: E004 the app cannot be imported, E001 a task's contract, E002 a
  pickle serializer, W012 a soft shutdown shorter than a task's expected duration, W004
  a task class nobody registered
- ``broker``: E003, W001 and W002 the Redis broker's visibility timeout and restore
  sweep against a task's lease and retries, W003 no broker URL, W011 RabbitMQ's
  ``consumer_timeout``, W014 RabbitMQ without publisher confirms, E009 prepared outbox
  messages on a broker other than Redis
- ``configuration``: E006/E007/E008 a setting outside its rule, unreadable, or against
  another; W013 an ``EXPLICIT_*`` setting nothing reads; E005 the ledger's database;
  W005 Celery or kombu outside the tested ranges
- ``keys``: W010 (``check --database default``) a task's key template renamed
- ``periodic``: W015 a periodic task whose key does not use its slot, W016
  (``check --database default``) a slot of a periodic entry no beat published

Retention's checks (E020, W021, W020) live beside the prune they guard
(``django_outbox.retention.checks``). Importing this package registers these
(``apps.py`` does, in ``ready()``).
"""

from django_outbox.checks.celery_app import check_celery_configuration
from django_outbox.checks.configuration import (
    check_ledger_database,
    check_settings,
    check_versions,
)
from django_outbox.checks.keys import check_key_renames
from django_outbox.checks.periodic import check_missed_slots, check_periodic_keys
from django_outbox.checks.reading import reads_settings

__all__ = [
    # the registered checks
    "check_celery_configuration",
    "check_key_renames",
    "check_ledger_database",
    "check_missed_slots",
    "check_periodic_keys",
    "check_settings",
    "check_versions",
    # for the checks elsewhere (retention's)
    "reads_settings",
]
