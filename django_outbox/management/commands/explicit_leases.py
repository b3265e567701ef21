"""``manage.py explicit_leases``: the jobs held right now, with owner, fence and deadline."""

from __future__ import annotations

from typing import Any

import redis
from django.core.management.base import BaseCommand

from celery_explicit import execution_lease, lease, redis_state
from django_outbox.conf import settings


class Command(BaseCommand):
    help = (
        "List live leases. Execution leases (any broker): task id, owner (host:pid), "
        "fencing token, age, seconds until another delivery may take the job over. "
        "Message leases (Redis broker): owner, extensions, seconds until the message is "
        "visible to other workers again."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        running = execution_lease.live_executions(redis_state.client())
        self.stdout.write("execution leases (one live execution per job):")
        if not running:
            self.stdout.write("  none")
        else:
            self.stdout.write(
                f"  {'task id':<38} {'owner':<28} {'fence':>7} {'age':>8} {'left':>8}"
            )
            for job in running:
                self.stdout.write(
                    f"  {job.task_id:<38} {job.owner:<28} {job.fence:>7} "
                    f"{job.age:>7.1f}s {job.expires_in:>7.1f}s"
                )
        broker = str(settings.celery_app().conf.broker_url or "")
        if not broker.startswith(("redis://", "rediss://")):
            self.stdout.write(f"message leases: none (the broker is not Redis: {broker!r})")
            return
        leases = lease.live_leases(redis.Redis.from_url(broker))
        self.stdout.write("message leases (per-task visibility timeout):")
        if not leases:
            self.stdout.write("  none")
            return
        self.stdout.write(f"  {'task id':<38} {'owner':<28} {'ext':>5} {'left':>8}")
        for held in leases:
            self.stdout.write(
                f"  {held.task_id:<38} {held.owner:<28} {held.extensions:>5} "
                f"{held.expires_in:>7.1f}s"
            )
