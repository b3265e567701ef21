from django.db import models


class Counter(models.Model):
    """A business row whose value must change once per idempotency key."""

    name = models.CharField(max_length=100, unique=True)
    value = models.IntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.name}={self.value}"


class Profile(models.Model):
    """A row rebuilt under a lease lock; the fencing token of its last write is kept."""

    user_id = models.IntegerField(unique=True)
    data = models.CharField(max_length=100, default="")
    fencing_token = models.BigIntegerField(null=True)

    def __str__(self) -> str:
        return f"profile {self.user_id}"


class OrderState(models.Model):
    """An entity whose events may arrive out of order; keeps its last applied version."""

    order_id = models.IntegerField(unique=True)
    status = models.CharField(max_length=20, default="new")
    version = models.BigIntegerField(null=True)

    def __str__(self) -> str:
        return f"order {self.order_id}: {self.status} (v{self.version})"


class CachedProfile(models.Model):
    """A row served through the versioned cache; ``version`` grows with each committed write."""

    user_id = models.IntegerField(unique=True)
    name = models.TextField(default="")
    version = models.IntegerField(default=1)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(version__gte=0), name="testapp_cachedprofile_version_gte_0"
            ),
        ]

    def __str__(self) -> str:
        return f"profile {self.user_id}: {self.name} (v{self.version})"
