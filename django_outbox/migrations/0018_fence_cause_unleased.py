from django.db import migrations, models


class Migration(migrations.Migration):
    """A fence's cause may be ``unleased``: a redelivery that found the lease free and
    fenced any earlier execution, naming no holder (help text only, no SQL)."""

    dependencies = [
        ("django_outbox", "0017_ledger_entry_names"),
    ]

    operations = [
        migrations.AlterField(
            model_name="fence",
            name="cause",
            field=models.CharField(
                blank=True,
                db_default="",
                default="",
                help_text=(
                    "holder_dead or lease_expired (celery_explicit.execution_lease); "
                    "unleased: a redelivery that found the lease free, naming no holder"
                ),
                max_length=16,
            ),
        ),
    ]
