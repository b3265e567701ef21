from django.db import models


class Row(models.Model):
    """One of 100 rows the benchmark tasks update (spread to avoid lock contention)."""

    value = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"row {self.pk}"
