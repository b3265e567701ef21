from django.db import models


class Row(models.Model):
    """One of 100 rows the benchmark tasks update (spread to avoid lock contention)."""

    value = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"row {self.pk}"


class ProcessedKey(models.Model):
    """The hand-rolled guard's ledger (bench/peers.py, bench/effect_cost.py P2b): one row per
    processed key, written with ``get_or_create`` in the effect's transaction.

    Unmanaged, so that it needs no migration in the bench app: ``ensure_processed_table``
    creates (and empties) its table.
    """

    key = models.CharField(max_length=255, primary_key=True)

    class Meta:
        app_label = "benchapp"
        managed = False
        db_table = "bench_processed_key"


def ensure_processed_table() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE IF NOT EXISTS bench_processed_key (key varchar(255) PRIMARY KEY)"
        )
        cursor.execute("TRUNCATE bench_processed_key")
