"""The outbox relay: claim committed events, publish them, mark them, and find the lost.

- ``loop``: ``Relay``, the loop a relay process runs, and its batches.
- ``claim``: the SQL that locks a batch of claimable events (``SKIP LOCKED``).
- ``publish``: turning an event into a Celery message and sending it.
- ``broker``: the broker connection the relay publishes through.
- ``wakeup``: ``LISTEN``/``NOTIFY`` so a committed event is relayed without polling.
- ``reconcile``: events published but never received, published again.
- ``metrics``: the relay's Prometheus series.
"""
