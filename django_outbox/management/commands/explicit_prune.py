"""``manage.py explicit_prune``: delete what the jobs left behind, past its retention.

Each table has its retention (``EXPLICIT_RETAIN_ATTEMPTS``, ``_FENCES``,
``_DEAD_LETTERS``, ``_OUTBOX``, ``_LEDGER``; seconds), or ``--older-than 7d`` for the
tables named with ``--table`` (a cron line that keeps its own). What is never deleted, and why
the ledger has a floor: ``django_outbox.retention``. Safe beside running workers, and
killed it is simply run again.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_outbox import retention
from django_outbox.conf import settings
from django_outbox.management.arguments import parse_duration, positive_int


class Command(BaseCommand):
    help = (
        "Delete attempts, fences, resolved dead letters, reconciled outbox events, "
        "ledger entries and cancellations older than their retention (EXPLICIT_RETAIN_*), "
        "in batches. Open "
        "dead letters and outbox events reconciliation may still republish are never "
        "deleted; the ledger is refused below its floor (manage.py check, E020)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--table",
            action="append",
            choices=retention.TABLES,
            help="prune only this table (repeat for several; default: all)",
        )
        parser.add_argument(
            "--batch-size",
            type=positive_int,
            default=1000,
            help="rows per delete, each in its own transaction (default 1000)",
        )
        parser.add_argument(
            "--older-than",
            help="retention for the --table tables instead of their setting: 7d, 12h, 30m, "
            "90s, 2w; a bare number is days",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="count what would be deleted, delete nothing"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        chosen = retention.tables(options["table"])
        override: float | None = None
        if options["older_than"] is not None:
            if not options["table"]:
                raise CommandError(
                    "explicit_prune --older-than needs --table: it overrides the retention "
                    "of the tables named, never all of them at once"
                )
            try:
                override = parse_duration(options["older_than"]).total_seconds()
            except ValueError as exc:
                raise CommandError(f"explicit_prune --older-than: {exc}") from None
        if "ledger" in chosen:
            # Before anything is deleted: a refused run changes nothing.
            try:
                retention.refuse_below_floor(
                    override if override is not None else retention.retention("ledger")
                )
            except retention.LedgerBelowFloor as exc:
                raise CommandError(
                    f"explicit_prune refuses to prune the ledger: {exc}. Raise "
                    f"{retention.setting_name('ledger')} to at least "
                    f"{exc.floor.seconds:.0f}, or leave the ledger out (--table)."
                ) from None
        for table in chosen:
            seconds = override if override is not None else retention.retention(table)
            name = "--older-than" if override is not None else retention.setting_name(table)
            age = f"older than {retention.human(seconds)} ({name})"
            if options["dry_run"]:
                found = retention.count(table, seconds=override)
                self.stdout.write(f"{table}: would delete {found} rows {age}")
                continue
            deleted = retention.prune(
                table,
                seconds=override,
                batch_size=options["batch_size"],
                progress=self._progress(table) if options["verbosity"] > 1 else None,
            )
            self.stdout.write(f"{table}: deleted {deleted} rows {age}")
        if options["dry_run"]:
            self.stdout.write(f"dry run: nothing deleted (database {settings.database!r})")

    def _progress(self, table: str) -> Any:
        def report(deleted: int) -> None:
            self.stdout.write(f"{table}: {deleted} rows deleted so far")

        return report
