from django.db import migrations


class Migration(migrations.Migration):
    """The ledger's admin names: an entry is a "ledger entry" (options only, no SQL)."""

    dependencies = [
        ("django_outbox", "0016_fence_holder_attempt_sent_at"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="processedoperation",
            options={"verbose_name": "ledger entry", "verbose_name_plural": "ledger entries"},
        ),
    ]
