"""``manage.py explicit_leases``: the jobs held right now, with owner, fence and deadline."""

from __future__ import annotations

from argparse import ArgumentParser
from collections.abc import Sequence
from typing import Any

import redis
from django.core.management.base import BaseCommand

from celery_explicit import execution_lease, message_lease, redis_state
from django_outbox.conf import settings


class Command(BaseCommand):
    help = (
        "List live leases. Execution leases (any broker): task id, owner (host:pid), "
        "fencing token, age, seconds until another delivery may take the job over. "
        "Message leases (Redis broker): owner, extensions, seconds until the message is "
        "visible to other workers again; a lease whose message is no longer held "
        "(acknowledged: its job is done) is left out unless --all, which marks it."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--all",
            action="store_true",
            help="also list message leases whose message was already acknowledged",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        running = execution_lease.live_executions(redis_state.client())
        self.stdout.write("execution leases (one live execution per job):")
        self._table(
            ("task id", "owner", "fence", "age", "left"),
            [
                (j.task_id, j.owner, str(j.fence), f"{j.age:.1f}s", f"{j.expires_in:.1f}s")
                for j in running
            ],
            numbers=range(2, 5),
        )
        app = settings.celery_app()
        broker = str(app.conf.broker_url or "")
        if not broker.startswith(("redis://", "rediss://")):
            self.stdout.write(f"message leases: none (the broker is not Redis: {broker!r})")
            return
        client = redis.Redis.from_url(broker)
        leases = message_lease.live_leases(client)
        held = _still_held(app, client, [held.delivery_tag for held in leases])
        done = [x for x, is_held in zip(leases, held, strict=True) if not is_held]
        shown = leases if options["all"] else [x for x in leases if x not in done]
        self.stdout.write("message leases (per-task visibility timeout):")
        self._table(
            ("task id", "owner", "ext", "left", "message"),
            [
                (
                    x.task_id,
                    x.owner,
                    str(x.extensions),
                    f"{x.expires_in:.1f}s",
                    "acked (done)" if x in done else "held",
                )
                for x in shown
            ],
            numbers=range(2, 4),
        )
        if done and not options["all"]:
            # The record of an acknowledged message stays until its worker's next
            # heartbeat or its own expiry: its job is over, nothing holds it.
            self.stdout.write(
                f"  ({len(done)} lease record(s) of messages already acknowledged not "
                "shown: --all lists them)"
            )

    def _table(self, header: Sequence[str], rows: list[Sequence[str]], *, numbers: range) -> None:
        """Columns as wide as their widest value (a 16-digit fence, a long host name):
        the ``numbers`` columns right-aligned, text left."""
        if not rows:
            self.stdout.write("  none")
            return
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            cells = [
                cell.rjust(width) if i in numbers else cell.ljust(width)
                for i, (cell, width) in enumerate(zip(row, widths, strict=True))
            ]
            self.stdout.write("  " + "  ".join(cells).rstrip())


def _still_held(app: Any, client: redis.Redis, tags: list[str]) -> list[bool]:
    """Whether each delivery tag is still unacknowledged: in kombu's ``unacked_index``
    (named as the workers' channel names it, with its ``global_keyprefix``). The ack
    removes it there at once; the lease record itself lingers until it expires."""
    if not tags:
        return []
    with app.connection_for_read() as conn:
        index = message_lease.unacked_index_key(conn.default_channel)
    pipe = client.pipeline(transaction=False)
    for tag in tags:
        pipe.zscore(index, tag)
    return [score is not None for score in pipe.execute()]
