"""The relay's reconciliation (``django_outbox.reconcile``): two columns on outbox events,
the dead-letter reason ``not_received``, and the index of events not yet checked.

The index is built ``CONCURRENTLY`` on PostgreSQL (outside a transaction): the outbox
is written by every business transaction and must not be locked while it is built.
Rows published before this migration start unchecked; the relay ages out those past
``EXPLICIT_OUTBOX_RECONCILE_HORIZON`` a batch at a time, and the index shrinks to the
last few minutes of publishes.
"""

from typing import Any

from django.db import migrations, models

UNCHECKED = models.Index(
    condition=models.Q(("checked_at__isnull", True), ("status", "published")),
    fields=["published_at"],
    name="django_outbox_ev_unchecked_idx",
)


def add_index(apps: Any, schema_editor: Any) -> None:
    model = apps.get_model("django_outbox", "OutboxEvent")
    if schema_editor.connection.vendor == "postgresql":
        sql = str(UNCHECKED.create_sql(model, schema_editor, concurrently=True))
        schema_editor.execute(
            sql.replace("CREATE INDEX CONCURRENTLY", "CREATE INDEX CONCURRENTLY IF NOT EXISTS", 1)
        )
    else:
        schema_editor.add_index(model, UNCHECKED)


def remove_index(apps: Any, schema_editor: Any) -> None:
    model = apps.get_model("django_outbox", "OutboxEvent")
    schema_editor.remove_index(model, UNCHECKED)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("django_outbox", "0011_search_indexes"),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name="deadletter",
            name="django_outbox_dl_reason_valid",
        ),
        migrations.AddField(
            model_name="outboxevent",
            name="checked_at",
            field=models.DateTimeField(
                blank=True, help_text="a worker's trace of its job was found", null=True
            ),
        ),
        migrations.AddField(
            model_name="outboxevent",
            name="republished",
            field=models.PositiveSmallIntegerField(
                default=0,
                db_default=0, help_text="published again: no worker had received it"
            ),
        ),
        migrations.AlterField(
            model_name="deadletter",
            name="reason",
            field=models.CharField(
                choices=[
                    ("permanent", "permanent error"),
                    ("unclassified", "unclassified error (classify it)"),
                    ("exhausted", "attempts exhausted"),
                    ("bad_input", "bad input"),
                    ("conflict", "idempotency conflict"),
                    ("delivery_limit", "delivered more than max_deliveries times"),
                    ("max_run_time", "ran longer than max_run_time"),
                    ("unknown_task", "no such task is registered"),
                    ("not_received", "published, never received by a worker"),
                ],
                max_length=32,
            ),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="outboxevent", index=UNCHECKED)],
            database_operations=[migrations.RunPython(add_index, remove_index)],
        ),
        migrations.AddConstraint(
            model_name="deadletter",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    (
                        "reason__in",
                        [
                            "permanent",
                            "unclassified",
                            "exhausted",
                            "bad_input",
                            "conflict",
                            "delivery_limit",
                            "max_run_time",
                            "unknown_task",
                            "not_received",
                        ],
                    )
                ),
                name="django_outbox_dl_reason_valid",
            ),
        ),
    ]
