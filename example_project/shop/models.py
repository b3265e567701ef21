from django.db import models


class PaymentStatus(models.TextChoices):
    AUTHORIZED = "authorized"
    CAPTURED = "captured"


class Payment(models.Model):
    amount_cents = models.PositiveIntegerField()
    status = models.CharField(
        max_length=16, choices=PaymentStatus.choices, default=PaymentStatus.AUTHORIZED
    )
    #: How many times money actually moved: must never exceed 1.
    captures = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return f"payment {self.pk} ({self.status})"


class InvoiceStatus(models.TextChoices):
    # Small, specific states: not a universal task state machine.
    PENDING = "pending"
    SENT = "sent"
    FAILED_PERMANENT = "failed_permanent"


class Invoice(models.Model):
    email = models.CharField(max_length=200)
    status = models.CharField(
        max_length=20, choices=InvoiceStatus.choices, default=InvoiceStatus.PENDING
    )

    def __str__(self) -> str:
        return f"invoice {self.pk} ({self.status})"


class StockLevel(models.Model):
    sku = models.CharField(max_length=50, unique=True)
    quantity = models.IntegerField(default=0)
    synced_quantity = models.IntegerField(null=True, blank=True)

    def __str__(self) -> str:
        return self.sku


class WarehouseOutage(models.Model):
    """A stand-in for a sick downstream: the next ``remaining`` calls time out."""

    remaining = models.PositiveIntegerField(default=0)


class Order(models.Model):
    """An order the warehouse ships, and whose status events arrive from elsewhere."""

    status = models.CharField(max_length=20, default="placed")
    #: Sequence of the last status event applied (versioned_update keeps it).
    status_version = models.BigIntegerField(null=True, blank=True)
    #: How many times the warehouse was asked to ship it: must never exceed 1.
    shipments = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return f"order {self.pk} ({self.status})"


class SalesReport(models.Model):
    """One day's sales, rebuilt from the payments; two rebuilds must never run at once."""

    day = models.DateField(unique=True)
    total_cents = models.BigIntegerField(default=0)
    rebuilds = models.PositiveIntegerField(default=0)
    #: The lease lock's fencing token of the last rebuild written (fenced_update keeps
    #: it): a rebuild that lost its lock while paused cannot overwrite a newer one.
    fencing_token = models.BigIntegerField(null=True, blank=True)

    def __str__(self) -> str:
        return f"sales report {self.day}"
