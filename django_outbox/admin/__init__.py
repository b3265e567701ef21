"""The admin: lists of attempts, dead letters, outbox events and the ledger, the job page,
the replay plan and the dashboard. Django's admin autodiscovery imports this package;
``lists`` registers the model admins.
"""

from django_outbox.admin import lists as lists  # registers the ModelAdmins
