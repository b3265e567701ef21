"""``manage.py explicit_locks``: the lease locks held right now, with owner and age."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from celery_explicit import locks, redis_state


class Command(BaseCommand):
    help = "List live lease locks: name, owner (host:pid), fencing token, age, time left."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--prefix",
            default=None,
            help="key prefix the locks were created with (default: EXPLICIT_KEY_PREFIX)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        client = redis_state.client()  # EXPLICIT_REDIS_URL, Sentinel included
        live = locks.live_locks(client, prefix=options["prefix"])
        if not live:
            self.stdout.write("no live locks")
            return
        self.stdout.write(f"{'lock':<40} {'owner':<28} {'fence':>17} {'age':>9} {'left':>9}")
        for lock in live:
            self.stdout.write(
                f"{lock.name:<40} {lock.owner:<28} {lock.fence:>17} "
                f"{lock.age:>8.1f}s {lock.expires_in:>8.1f}s"
            )
