# The ledger table takes its model's name (it was django_outbox_effect): one name in Python,
# SQL and the docs. A rename, not a copy: no row moves.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('django_outbox', '0006_outbox'),
    ]

    operations = [
        migrations.RenameIndex(
            model_name='processedoperation',
            new_name='django_outbox_processed_at_idx',
            old_name='django_outbox_effect_at_idx',
        ),
        migrations.AlterModelTable(
            name='processedoperation',
            table='django_outbox_processed_operation',
        ),
    ]
