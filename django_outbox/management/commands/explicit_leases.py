"""``manage.py explicit_leases``: the messages held right now, with owner and deadline."""

from __future__ import annotations

from typing import Any

import redis
from django.core.management.base import BaseCommand, CommandError

from celery_explicit import lease
from django_outbox.conf import settings


class Command(BaseCommand):
    help = (
        "List live per-task leases (Redis broker): task id, owner (host:pid), "
        "extensions, seconds until the message is visible to other workers again."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        broker = str(settings.celery_app().conf.broker_url or "")
        if not broker.startswith(("redis://", "rediss://")):
            raise CommandError(f"leases live in a Redis broker; this broker is {broker!r}")
        leases = lease.live_leases(redis.Redis.from_url(broker))
        if not leases:
            self.stdout.write("no live leases")
            return
        self.stdout.write(f"{'task id':<38} {'owner':<28} {'ext':>5} {'left':>8}")
        for held in leases:
            self.stdout.write(
                f"{held.task_id:<38} {held.owner:<28} {held.extensions:>5} {held.expires_in:>7.1f}s"
            )
