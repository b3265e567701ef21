from django.db import migrations, models


class Migration(migrations.Migration):
    """The version of the code on each attempt, dead letter and ledger entry. A column
    with a database default: PostgreSQL adds it without rewriting the table."""

    dependencies = [
        ("django_outbox", "0018_fence_cause_unleased"),
    ]

    operations = [
        migrations.AddField(
            model_name="attempt",
            name="app_version",
            field=models.CharField(
                blank=True,
                db_default="",
                default="",
                help_text="version of the code that ran it (celery_explicit.app_version)",
                max_length=64,
            ),
        ),
        migrations.AddField(
            model_name="deadletter",
            name="app_version",
            field=models.CharField(
                blank=True,
                db_default="",
                default="",
                help_text="version of the code that wrote it (celery_explicit.app_version)",
                max_length=64,
            ),
        ),
        migrations.AddField(
            model_name="processedoperation",
            name="app_version",
            field=models.CharField(
                blank=True,
                db_default="",
                default="",
                help_text="version of the code that applied it (celery_explicit.app_version)",
                max_length=64,
            ),
        ),
    ]
