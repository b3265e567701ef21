"""What the tests need around the code under test: managed processes (workers, relays,
private servers), waiting, free ports and reading the broker's queues.

- ``processes``: start a subprocess with its log file, wait until it is ready, stop it
  and its process group.
- ``workers``: a real ``celery worker`` (``Worker``).
- ``relays``: real ``explicit_relay`` processes (``relay_starter``) and the negative-control
  relays they can run.
- ``servers``: servers of a test's own (``PrivateRedis``).
- ``waiting``: ``wait_for``.
- ``ports``: ``free_port``.
- ``queues``: what a Redis-broker queue holds (``queued``).
"""
