"""``manage.py explicit_locks``: the lease locks held right now, with owner and age."""

from __future__ import annotations

from typing import Any

import redis
from django.core.management.base import BaseCommand, CommandParser

from celery_explicit import locks
from celery_explicit.redis_state import PREFIX
from django_outbox.conf import settings


class Command(BaseCommand):
    help = "List live lease locks: name, owner (host:pid), fencing token, age, time left."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--prefix", default=PREFIX, help="key prefix the locks were created with"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        client = redis.Redis.from_url(settings.redis_url)
        live = locks.live_locks(client, prefix=options["prefix"])
        if not live:
            self.stdout.write("no live locks")
            return
        self.stdout.write(f"{'lock':<40} {'owner':<28} {'fence':>7} {'age':>9} {'left':>9}")
        for lock in live:
            self.stdout.write(
                f"{lock.name:<40} {lock.owner:<28} {lock.fence:>7} "
                f"{lock.age:>8.1f}s {lock.expires_in:>8.1f}s"
            )
