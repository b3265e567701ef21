from django.db import migrations, models


class Migration(migrations.Migration):
    """The slots beats published of periodic entries (``celery_explicit.periodic``)."""


    dependencies = [
        ('django_outbox', '0020_cancellation'),
    ]

    operations = [
        migrations.CreateModel(
            name='PeriodicSlot',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('entry', models.CharField(max_length=200)),
                ('slot', models.DateTimeField()),
                ('task_name', models.CharField(max_length=255)),
                ('task_id', models.CharField(max_length=255)),
                ('idempotency_key', models.CharField(blank=True, default='', max_length=255)),
                ('published_at', models.DateTimeField()),
                ('published_by', models.CharField(blank=True, default='', max_length=255)),
                ('grid', models.CharField(blank=True, default='', max_length=255)),
            ],
            options={
                'db_table': 'django_outbox_periodic_slot',
                'indexes': [models.Index(fields=['task_id'], name='django_outbox_slot_task_idx'), models.Index(fields=['slot'], name='django_outbox_slot_time_idx')],
                'constraints': [models.UniqueConstraint(fields=('entry', 'slot'), name='django_outbox_slot_once')],
            },
        ),
    ]
