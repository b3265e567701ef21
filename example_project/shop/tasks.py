"""The shop's jobs, each with its contract declared on the task."""

from __future__ import annotations

from django.db import transaction
from django.db.models import F
from shop_project.celery import app

from celery_explicit import ExplicitTask, effect
from shop.models import Invoice, InvoiceStatus, Payment, PaymentStatus, StockLevel, WarehouseOutage


class GatewayTimeout(Exception):
    """The payment gateway or warehouse did not answer in time: transient."""


class CardDeclined(Exception):
    """The card was declined: retrying will not change the answer."""


class InvalidAddress(Exception):
    """The invoice's e-mail address is not deliverable: permanent."""


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
                status=PaymentStatus.CAPTURED, captures=F("captures") + 1)
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


@app.task(base=ExplicitTask, name="shop.send_invoice_email",
          idempotency_key="invoice:{invoice_id}:send_email", visibility_timeout=120,
          expected_duration=10, retry_on=(GatewayTimeout,), fail_on=(InvalidAddress,))
def send_invoice_email(invoice_id: int) -> None:
    invoice = Invoice.objects.get(id=invoice_id)
    if "@" not in invoice.email:
        Invoice.objects.filter(id=invoice_id).update(status=InvoiceStatus.FAILED_PERMANENT)
        raise InvalidAddress(f"invoice {invoice_id}: {invoice.email!r} is not an address")
    with effect() as sent:
        if sent.done:
            return
        Invoice.objects.filter(id=invoice_id).update(status=InvoiceStatus.SENT)


app.register_task(CapturePayment())
app.register_task(SyncStock())
