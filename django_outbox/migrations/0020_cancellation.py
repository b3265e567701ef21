from django.db import migrations, models


class Migration(migrations.Migration):
    """Cancellations (``celery_explicit.cancellation``), and the attempt outcome
    ``cancelled`` in the outcomes' check constraint (rebuilt, so PostgreSQL reads the
    attempts table once to validate it)."""

    dependencies = [
        ("django_outbox", "0019_app_version"),
    ]

    operations = [
        migrations.CreateModel(
            name="Cancellation",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("task_id", models.CharField(blank=True, default="", max_length=255)),
                ("idempotency_key", models.CharField(blank=True, default="", max_length=255)),
                ("task_name", models.CharField(blank=True, default="", max_length=255)),
                ("requested_by", models.CharField(max_length=150)),
                ("requested_at", models.DateTimeField()),
                ("reason", models.TextField(blank=True, default="")),
            ],
            options={
                "db_table": "django_outbox_cancellation",
            },
        ),
        migrations.RemoveConstraint(
            model_name="attempt",
            name="django_outbox_attempt_outcome_valid",
        ),
        migrations.AlterField(
            model_name="attempt",
            name="outcome",
            field=models.CharField(
                choices=[
                    ("applied", "effect applied"),
                    ("already_applied", "already applied (duplicate absorbed)"),
                    ("succeeded", "succeeded (no effect block)"),
                    ("retry_scheduled", "retry scheduled"),
                    ("failed_permanent", "failed: permanent error"),
                    ("failed_unclassified", "failed: unclassified error"),
                    ("exhausted", "failed: attempts exhausted"),
                    ("bad_input", "bad input"),
                    ("conflict", "idempotency conflict (other arguments)"),
                    ("deduplicated", "dropped: another message owns its dedup id"),
                    ("delivery_limit", "not run: delivered more than max_deliveries times"),
                    ("max_run_time", "stopped: ran longer than max_run_time"),
                    (
                        "fenced",
                        "refused: lost its lease to a newer execution (stale fencing token)",
                    ),
                    ("database_unavailable", "deferred: the database could not be written"),
                    ("cancelled", "cancelled by an operator: not run, or its effect refused"),
                ],
                max_length=32,
            ),
        ),
        migrations.AddConstraint(
            model_name="attempt",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    (
                        "outcome__in",
                        [
                            "applied",
                            "already_applied",
                            "succeeded",
                            "retry_scheduled",
                            "failed_permanent",
                            "failed_unclassified",
                            "exhausted",
                            "bad_input",
                            "conflict",
                            "deduplicated",
                            "delivery_limit",
                            "max_run_time",
                            "fenced",
                            "database_unavailable",
                            "cancelled",
                        ],
                    )
                ),
                name="django_outbox_attempt_outcome_valid",
            ),
        ),
        migrations.AddIndex(
            model_name="cancellation",
            index=models.Index(fields=["task_id"], name="django_outbox_cancel_task_idx"),
        ),
        migrations.AddIndex(
            model_name="cancellation",
            index=models.Index(fields=["idempotency_key"], name="django_outbox_cancel_key_idx"),
        ),
        migrations.AddConstraint(
            model_name="cancellation",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(("task_id", ""), _negated=True),
                    models.Q(("idempotency_key", ""), _negated=True),
                    _connector="OR",
                ),
                name="django_outbox_cancel_names_a_job",
            ),
        ),
    ]
