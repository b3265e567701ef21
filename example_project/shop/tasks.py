"""The shop's jobs, each with its contract declared on the task."""

from __future__ import annotations

import time
from datetime import date

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import F, Sum
from shop_project.celery import app

from celery_explicit import (
    Downstream,
    ExplicitTask,
    LeaseLock,
    LockNotAcquired,
    RateLimit,
    effect,
)
from django_outbox.cache.versioned import VersionedCache
from django_outbox.store.guarded_writes import fenced_update, versioned_update
from shop.models import (
    Invoice,
    InvoiceStatus,
    Order,
    Payment,
    PaymentStatus,
    SalesReport,
    StockLevel,
    WarehouseOutage,
)


class GatewayTimeout(Exception):
    """The payment gateway or warehouse did not answer in time: transient."""


class CardDeclined(Exception):
    """The card was declined: retrying will not change the answer."""


class InvalidAddress(Exception):
    """The invoice's e-mail address is not deliverable: permanent."""


#: The warehouse API, shared by every worker: at most 2 calls at once, and a circuit
#: breaker that defers calls while it keeps failing.
WAREHOUSE = Downstream("warehouse", concurrency=2, failure_threshold=5, cool_down=10.0)


def _order_status(*, order_id: int) -> tuple[str, int]:
    order = Order.objects.get(id=order_id)
    return order.status, order.status_version or 0


#: An order's status as pages show it: cached with its version, bumped after commit.
ORDER_STATUS = VersionedCache("order_status:{order_id}", source=_order_status)


class CapturePayment(ExplicitTask):
    name = "shop.capture_payment"
    idempotency_key = "payment:{payment_id}:capture"
    visibility_timeout = 60
    expected_duration = 5
    retry_on = (GatewayTimeout,)
    fail_on = (CardDeclined,)

    def run(self, payment_id: int) -> str:
        with self.effect() as captured:
            if captured.done:  # a redelivery or a duplicate publish: say so, do nothing
                return captured.result_ref
            # The gateway call would carry self.request.idempotency_key as its
            # Idempotency-Key header, so the gateway too can refuse a second capture.
            Payment.objects.filter(id=payment_id, status=PaymentStatus.AUTHORIZED).update(
                status=PaymentStatus.CAPTURED, captures=F("captures") + 1
            )
            captured.result_ref = f"capture-{payment_id}"
        return captured.result_ref


class SyncStock(ExplicitTask):
    name = "shop.sync_stock"
    idempotency_key = "stock:{sku}:sync:{quantity}"
    visibility_timeout = 30
    expected_duration = 2
    retry_on = (GatewayTimeout,)
    fail_on = ()
    max_attempts = 5
    backoff_base = 0.5
    backoff_cap = 5.0
    downstream = WAREHOUSE

    def run(self, sku: str, quantity: int) -> None:
        with transaction.atomic():
            outage = WarehouseOutage.objects.select_for_update().first()
            if outage and outage.remaining:
                outage.remaining -= 1
                outage.save(update_fields=["remaining"])
                failing = True
            else:
                failing = False
        if failing:
            raise GatewayTimeout(f"warehouse did not answer for {sku}")
        self.set_external_request_id(f"wh-{sku}-{quantity}")
        with self.effect() as synced:
            if synced.done:
                return
            StockLevel.objects.filter(sku=sku).update(synced_quantity=quantity)


@app.task(
    base=ExplicitTask,
    name="shop.send_invoice_email",
    idempotency_key="invoice:{invoice_id}:send_email",
    visibility_timeout=120,
    expected_duration=10,
    retry_on=(GatewayTimeout,),
    fail_on=(InvalidAddress,),
)
def send_invoice_email(invoice_id: int) -> None:
    invoice = Invoice.objects.get(id=invoice_id)
    if "@" not in invoice.email:
        Invoice.objects.filter(id=invoice_id).update(status=InvoiceStatus.FAILED_PERMANENT)
        raise InvalidAddress(f"invoice {invoice_id}: {invoice.email!r} is not an address")
    with effect() as sent:
        if sent.done:
            return
        Invoice.objects.filter(id=invoice_id).update(status=InvoiceStatus.SENT)


class ShipOrder(ExplicitTask):
    """The article's incident: the warehouse is slow today, far slower than the lease.

    Its lease is 2 s; the warehouse takes ``warehouse_seconds`` (6 s in the demo, three
    times the lease). The worker extends the lease while the handler is alive, so the
    job runs once; without that (``EXPLICIT_LEASE_EXTEND=0``) the broker hands it to a
    second worker, and fencing refuses the first one's late commit.
    """

    name = "shop.ship_order"
    idempotency_key = "order:{order_id}:ship"
    visibility_timeout = 2
    expected_duration = 1
    retry_on = (GatewayTimeout,)
    fail_on = ()

    def run(self, order_id: int, warehouse_seconds: float = 0.0) -> None:
        time.sleep(warehouse_seconds)  # the warehouse takes its time
        with self.effect() as shipped:
            if shipped.done:
                return
            Order.objects.filter(id=order_id).update(shipments=F("shipments") + 1, status="shipped")


class ApplyOrderStatus(ExplicitTask):
    """Status events for one order run one at a time, in the order they were published;
    each write also carries the event's sequence, so a straggler cannot win."""

    name = "shop.apply_order_status"
    idempotency_key = "order:{order_id}:status:{seq}"
    ordering_key = "order:{order_id}"
    visibility_timeout = 30
    expected_duration = 1
    retry_on = ()
    fail_on = ()

    def run(self, order_id: int, seq: int, status: str) -> None:
        with self.effect() as applied:
            if applied.done:
                return
            versioned_update(
                Order.objects.filter(id=order_id),
                version=seq,
                field="status_version",
                status=status,
            )
            ORDER_STATUS.bump(seq, order_id=order_id)  # runs after the commit


class RecordPaymentWebhook(ExplicitTask):
    """The payment provider resends its webhooks: the same event id is one job."""

    name = "shop.record_payment_webhook"
    idempotency_key = "payment:{payment_id}:webhook:{event_id}"
    dedup_key = "{event_id}"
    dedup_window = 600
    visibility_timeout = 30
    expected_duration = 1
    retry_on = ()
    fail_on = ()

    def run(self, event_id: str, payment_id: int) -> None:
        with self.effect() as recorded:
            if recorded.done:
                return
            recorded.result_ref = event_id


class RebuildSalesReport(ExplicitTask):
    """A day's sales report, rebuilt on a schedule and by hand: one rebuild at a time.

    The lease lock (not the ledger) keeps two rebuilds of one day apart: each rebuild
    is a new effect (its own ``run_id``), but two at once would race on the report. A
    rebuild that finds the lock held is retried with backoff; the fencing token goes
    with the write, so a holder that paused past its lock's TTL cannot overwrite the
    newer report.
    """

    name = "shop.rebuild_sales_report"
    idempotency_key = "report:{day}:rebuild:{run_id}"
    visibility_timeout = 30
    expected_duration = 2
    retry_on = (LockNotAcquired,)
    fail_on = ()
    max_attempts = 10
    backoff_base = 0.5
    backoff_cap = 2.0

    def run(self, day: str, run_id: str, aggregate_seconds: float = 0.0) -> int:
        lock = LeaseLock(_redis(), f"report:{day}", ttl=10.0)
        with lock.hold(wait=0) as fence:  # held elsewhere: LockNotAcquired, retried
            total = (
                Payment.objects.filter(status=PaymentStatus.CAPTURED).aggregate(
                    total=Sum("amount_cents")
                )["total"]
                or 0
            )
            time.sleep(aggregate_seconds)  # a slow aggregation, inside the lock's TTL
            with self.effect() as rebuilt:
                if rebuilt.done:
                    return int(rebuilt.result_ref.split()[-1])
                fenced_update(
                    SalesReport.objects.filter(day=date.fromisoformat(day)),
                    token=fence,
                    total_cents=total,
                    rebuilds=F("rebuilds") + 1,
                )
                rebuilt.result_ref = f"fencing token {fence}"
        return fence


#: The courier's label API takes three requests a second per courier account, however
#: many workers ask: kept in Redis for all of them together.
COURIER_LABELS = RateLimit("courier:{courier}", 3, per=1.0)


class PrintShippingLabel(ExplicitTask):
    """An order's shipping label from its courier's API, within the courier's rate limit.

    A label over the limit is not held in a pool slot: it is deferred to a start booked
    for it, so another courier's label starts as soon as a worker reaches it.
    """

    name = "shop.print_shipping_label"
    idempotency_key = "order:{order_id}:label"
    rate_limit = COURIER_LABELS
    visibility_timeout = 30
    expected_duration = 1
    retry_on = (GatewayTimeout,)
    fail_on = ()

    def run(self, order_id: int, courier: str) -> None:
        with self.effect() as printed:
            if printed.done:
                return
            printed.result_ref = f"{courier} label"


class SettlePayouts(ExplicitTask):
    """The sellers' payouts, settled on a schedule by ``celery beat`` (every night in a
    real shop; every two seconds in the demo).

    ``periodic = True``: the beat (``celery_explicit.beat.PersistentScheduler``) claims
    each schedule slot before publishing it, so a second beat running at the same time
    (a deploy's overlap) publishes nothing; the slot is ``run()``'s argument and names the
    effect, so even a copy the claim missed settles a slot once.
    """

    name = "shop.settle_payouts"
    periodic = True
    idempotency_key = "payouts:{slot}"
    visibility_timeout = 30
    expected_duration = 1
    retry_on = ()
    fail_on = ()

    def run(self, slot: str) -> None:
        with self.effect() as settled:
            if settled.done:
                return
            settled.result_ref = f"payouts of slot {slot}"


def _redis() -> redis.Redis:
    # The worker's broker is the shop's Redis; one client per process.
    global _client
    if _client is None:
        _client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    return _client


_client: redis.Redis | None = None


app.register_task(CapturePayment())
app.register_task(RebuildSalesReport())
app.register_task(RecordPaymentWebhook())
app.register_task(SyncStock())
app.register_task(ShipOrder())
app.register_task(ApplyOrderStatus())
app.register_task(PrintShippingLabel())
app.register_task(SettlePayouts())
