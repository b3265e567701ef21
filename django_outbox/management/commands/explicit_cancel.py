"""``manage.py explicit_cancel``: cancel a job, as data that outlives every worker.

``explicit_cancel <task id>`` cancels one job our rows know (outbox, attempts, dead
letters, ledger); ``explicit_cancel --key ship:42`` cancels every job of that key whose
effect has not committed, known or not (a job published with ``apply_async`` and not
run yet has no row: its key names it). Only tasks that declare ``cancellable = True``
honour it (``celery_explicit.cancellation``): not run if not started, its effect's
commit refused if running. An effect that committed cannot be cancelled: the command
says so, names the ledger entry and exits 1. One line of output either way.
"""

from __future__ import annotations

import getpass
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from django_outbox import times
from django_outbox.store import cancellations


class Command(BaseCommand):
    help = (
        "Cancel a job by task id (or every job of an idempotency key with --key) before "
        "its effect: stored in the database with who and when, honoured by cancellable "
        "tasks when they start and at their effect's commit, whether or not a worker runs."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("task_id", nargs="?", default="", help="the job's task id")
        parser.add_argument("--key", default="", help="cancel every job of this idempotency key")
        parser.add_argument(
            "--by", default="", help="who cancels (default: this shell's user), kept on the row"
        )
        parser.add_argument("--reason", default="", help="why, kept on the row")

    def handle(self, *args: Any, **options: Any) -> None:
        by = options["by"] or _shell_user()
        try:
            row, new = cancellations.cancel(
                task_id=options["task_id"], key=options["key"], by=by, reason=options["reason"]
            )
        except cancellations.NotCancelled as exc:
            raise CommandError(str(exc)) from None
        except DatabaseError as exc:
            raise CommandError(
                f"nothing cancelled: the database refused ({type(exc).__name__}: {exc}); "
                "run it again"
            ) from None
        what = f"task {row.task_id}" if row.task_id else f"key {row.idempotency_key}"
        if new:
            self.stdout.write(
                f"cancelled {what} (cancellation {row.pk}, by {row.requested_by}): "
                "cancellable jobs of it will not run, and no effect of it will commit"
            )
        else:
            self.stdout.write(
                f"{what} was already cancelled by {row.requested_by} at "
                f"{times.shown(row.requested_at)} (cancellation {row.pk})"
            )


def _shell_user() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return "manage.py"
