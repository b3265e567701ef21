"""The admin's lists, one module per table: importing this package registers them.

- ``read_only``: the base every list shares (evidence is read-only; times in UTC)
- ``attempts``: the attempts, with the job, window and dashboard pages under them
- ``ledger``: the ledger entries and the fences
- ``dead_letters``: the dead letters, with replay and discard
- ``outbox``: the outbox events, with "retry now"
- ``cancellations``: the cancellations, and the action that cancels selected jobs
"""

from django_outbox.admin.lists import attempts as attempts
from django_outbox.admin.lists import cancellations as cancellations
from django_outbox.admin.lists import dead_letters as dead_letters
from django_outbox.admin.lists import ledger as ledger
from django_outbox.admin.lists import outbox as outbox
