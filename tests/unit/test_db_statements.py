"""Every statement in ``django_outbox.db`` names the tables and statuses of our models.

The statements are written out (``db`` imports no model), so a renamed table, column
or status must fail here rather than in production. The claim's own shape is checked
in ``test_outbox_package.py``.
"""

from __future__ import annotations

import re

import pytest

from django_outbox.db import attempts_sql, ledger_sql, outbox_sql, relay_sql
from django_outbox.models import (
    Attempt,
    Cancellation,
    Fence,
    OutboxEvent,
    OutboxStatus,
    ProcessedOperation,
)

MODULES = (attempts_sql, ledger_sql, outbox_sql, relay_sql)

STATEMENTS = {
    f"{module.__name__.rsplit('.', 1)[1]}.{name}": getattr(module, name)
    for module in MODULES
    for name in module.__all__
    if isinstance(getattr(module, name), str)
    and name not in ("STALE_MARKER", "CANCELLED_MARKER", "CANCELLED_END")
}

TABLES = {
    model._meta.db_table: model
    for model in (Attempt, Cancellation, Fence, OutboxEvent, ProcessedOperation)
}


def test_every_module_lists_its_statements() -> None:
    for module in MODULES:
        constants = {n for n in vars(module) if n.isupper() and not n.startswith("_")}
        assert constants == set(module.__all__), module.__name__


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_the_statement_names_model_tables_and_their_columns(name: str) -> None:
    sql = STATEMENTS[name]
    # What each statement reads or writes: not a CTE's name, nor ``FROM event.x``
    # (extract()'s) or ``DO UPDATE SET`` / ``FOR UPDATE OF``.
    ctes = set(
        re.findall(
            r"(?:\bWITH(?:\s+RECURSIVE)?|,)\s+(\w+)(?:\([^)]*\))?\s+AS\s+(?:MATERIALIZED\s+)?\(",
            sql,
        )
    )
    named = set(re.findall(r"\b(?:FROM|INTO|(?<!DO )(?<!FOR )UPDATE)\s+(\w+)\b(?!\.)", sql)) - ctes
    named |= set(re.findall(r"\bdjango_outbox_\w+", sql))
    for table in named:
        assert table in TABLES, f"{name}: {table} is not a model's table"
    if not named:
        return
    (table,) = named  # one table a statement
    columns = {f.column for f in TABLES[table]._meta.concrete_fields}
    listed = re.search(rf"INTO {table} \(([^)]*)\)", sql)
    if listed is not None and "{" not in listed[1]:
        assert set(re.findall(r"\w+", listed[1])) <= columns, name
    assigned = re.findall(r"(?:SET|,)\s+(\w+) = ", sql)
    assert set(assigned) <= columns, name


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_the_statement_names_only_outbox_statuses_that_exist(name: str) -> None:
    statuses = re.findall(r"status = '(\w+)'", STATEMENTS[name])
    assert set(statuses) <= set(OutboxStatus.values), name
