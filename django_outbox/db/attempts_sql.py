"""The attempts' statements: one attempt row per execution, written or replaced.

The row's columns are the job path's (``celery_explicit.records.attempt_fields``), so
each statement is a template with the column list left to fill in
(``store.attempts.insert_statement``); the table name is a literal
(``tests/unit/test_db_statements.py`` checks it against ``Attempt``).
"""

from __future__ import annotations

__all__ = ["INSERT", "REPLACE"]

# INSERT - the attempt's row; ``{columns}`` the row's columns, ``{placeholders}`` one
#   ``%s`` for each
# %s each column's value, in ``{columns}``' order
# returns nothing
# locks nothing but the new row
# Run inside the effect's transaction when the attempt ran an effect block (an
# ``applied`` row exists exactly when the effect committed), else on its own.
INSERT = "INSERT INTO django_outbox_attempt ({columns}) VALUES ({placeholders})"

# REPLACE - the row an earlier effect block of the same attempt wrote, written over;
#   ``{assignments}`` is ``column = %s`` for each column
# %s each column's value, then the row's task_id, attempt number and started_at
# returns nothing; the cursor's rowcount says whether the row was there
# locks that row
# task_id, attempt and started_at name one execution: the index on task_id finds it.
REPLACE = (
    "UPDATE django_outbox_attempt SET {assignments} "
    "WHERE task_id = %s AND attempt = %s AND started_at = %s"
)
