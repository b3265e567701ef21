"""Publishing jobs and events so that none is lost between a commit and the broker.

- ``events``: ``publish_event`` and the write of an outbox row in the caller's transaction.
- ``dispatch``: ``dispatch()``, a job published after commit (or durably, through an event).
- ``relay``: the process that claims committed events and publishes them
  (``manage.py explicit_relay``).
"""
