"""``manage.py explicit_relay``: publish committed outbox events (``outbox.relay.loop``)."""

from __future__ import annotations

import signal
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_outbox.conf import settings
from django_outbox.management.arguments import positive_int, positive_seconds
from django_outbox.outbox.relay.loop import Relay, Wakeup


class Command(BaseCommand):
    help = (
        "Publish committed outbox events to the broker, at least once, in order per "
        "ordering key. Run one or more beside your workers; SIGTERM finishes the batch "
        "in hand and exits."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--batch-size",
            type=positive_int,
            default=None,
            help="events per claim (default EXPLICIT_OUTBOX_BATCH_SIZE, "
            f"{settings.outbox_batch_size})",
        )
        parser.add_argument(
            "--poll-interval",
            type=positive_seconds,
            default=None,
            help="seconds an idle relay waits before looking again (default "
            f"EXPLICIT_OUTBOX_POLL_INTERVAL, {settings.outbox_poll_interval:g})",
        )
        parser.add_argument(
            "--metrics-port",
            type=int,
            default=None,
            help="serve the relay's Prometheus metrics on this port (default "
            "EXPLICIT_RELAY_METRICS_PORT; 0 is off)",
        )
        parser.add_argument(
            "--reconcile-after",
            type=float,
            default=None,
            help="seconds after its publish before an event no worker received is "
            "published again (default EXPLICIT_OUTBOX_RECONCILE_AFTER, "
            f"{settings.outbox_reconcile_after:g}; 0 is off; django_outbox.outbox.relay.reconcile)",
        )
        parser.add_argument(
            "--once",
            action="store_true",
            help="publish what is claimable now, then exit (cron, or a one-off drain)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # The project's Celery app is used as it is: its settings are read, never
        # written (see "The Celery app is read, never written" in django_outbox.outbox.relay.loop).
        relay = Relay(batch_size=options["batch_size"], poll_interval=options["poll_interval"])
        if options["reconcile_after"] is not None:
            if options["reconcile_after"] < 0:
                raise CommandError(
                    f"--reconcile-after must be 0 (off) or more seconds, not "
                    f"{options['reconcile_after']:g}"
                )
            relay.reconciler.after = options["reconcile_after"]
        port = options["metrics_port"]
        self._serve_metrics(settings.relay_metrics_port if port is None else port)
        if options["once"]:
            totals = relay.drain()
        else:
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, lambda *_: relay.stop())

            def ready(wakeup: Wakeup) -> None:
                self.stdout.write(
                    f"outbox relay ready: database {relay.using!r}, batch "
                    f"{relay.batch_size}, wake-up: {wakeup.kind}, poll every "
                    f"{relay.poll_interval:g}s, reconcile "
                    + (f"after {relay.reconciler.after:g}s" if relay.reconciler.enabled else "off")
                )
                self.stdout.flush()

            totals = relay.run(on_ready=ready)
        self.stdout.write(
            f"outbox relay stopped: {totals.published} published, {totals.deduplicated} "
            f"deduplicated, {totals.dead_lettered} dead-lettered, {totals.failed} failed "
            "(retried later)"
        )
        if options["once"] and totals.broker_error is not None:
            raise CommandError(f"broker unavailable: {totals.broker_error}")

    def _serve_metrics(self, port: int) -> None:
        """The relay's counters and publish lag (``django_outbox.outbox.relay.metrics``), from
        this process's own registry. A port that cannot be bound is said once; the
        relay publishes anyway (its metrics are not worth a stopped outbox)."""
        if port <= 0:
            return
        from django_outbox.outbox.relay import metrics as relay_metrics

        try:
            address = relay_metrics.serve(port)
        except OSError as exc:
            self.stderr.write(f"relay metrics not served on port {port}: {exc}")
            return
        self.stdout.write(f"relay metrics on {address}")
