from django.db import migrations, models


class Migration(migrations.Migration):
    """An outbox row's prepared broker message (``django_outbox.outbox.prepared``); ''
    for every existing row, which the relay goes on building as before."""

    dependencies = [
        ('django_outbox', '0021_periodic_slot'),
    ]

    operations = [
        migrations.AddField(
            model_name='outboxevent',
            name='message',
            field=models.TextField(blank=True, db_default='', default='', help_text='the prepared broker message, if any'),
        ),
        migrations.AddField(
            model_name='outboxevent',
            name='message_format',
            field=models.CharField(blank=True, db_default='', default='', help_text="the prepared message's layout and the version that wrote it", max_length=100),
        ),
    ]
