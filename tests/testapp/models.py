from django.db import models


class Counter(models.Model):
    """A business row whose value must change once per idempotency key."""

    name = models.CharField(max_length=100, unique=True)
    value = models.IntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.name}={self.value}"
