"""Retention: which rows of our tables may be deleted, when, and how.

Every job leaves rows behind: an attempt per execution, a ledger entry per effect, a
fence per lease takeover, a dead letter per job that needs a human, an outbox event per
job published through the outbox. ``manage.py explicit_prune`` deletes those older
than their retention (``EXPLICIT_RETAIN_*``, seconds). By module:

- ``periods``: the tables, the setting that keeps each, how a retention reads;
- ``pruning``: which rows are due, and the batches that delete them;
- ``floor``: the ledger's floor, below which a prune would reopen duplicates;
- ``checks``: E020, W021 and W020, registered when ``apps.py`` imports this package.
"""

from django_outbox.retention import checks as checks  # registers E020, W021, W020
from django_outbox.retention.checks import check_pruned, check_retention
from django_outbox.retention.floor import (
    Floor,
    LedgerBelowFloor,
    Term,
    ledger_floor,
    refuse_below_floor,
    retry_schedule,
)
from django_outbox.retention.periods import TABLES, human, retention, setting_name, tables
from django_outbox.retention.pruning import count, prune, reconciled

__all__ = [
    # the tables and their retention
    "TABLES",
    "human",
    "retention",
    "setting_name",
    "tables",
    # pruning
    "count",
    "prune",
    "reconciled",
    # the ledger's floor
    "Floor",
    "LedgerBelowFloor",
    "Term",
    "ledger_floor",
    "refuse_below_floor",
    "retry_schedule",
    # checks
    "check_pruned",
    "check_retention",
]
