"""A lease-lock holder in a process of its own, for test_paused_lock_holder.py: the test
stops it (SIGSTOP) while it holds the lock, so the pause is a real one, not a sleep in
the test.

``python -m tests.chaos.lock_holder PREFIX FENCED`` reads commands on stdin and answers
one line each on stdout:

- ``acquire USER TTL`` → ``held <fencing token>``
- ``write USER`` → ``refused`` | ``accepted <token>`` (the stale write it attempts;
  fenced: ``fenced_update`` with its token; unfenced: a plain update)
"""

from __future__ import annotations

import sys


def main() -> None:
    import django

    django.setup()
    from celery_explicit import redis_state
    from celery_explicit.errors import StaleFencingToken
    from celery_explicit.locks import LeaseLock
    from django_outbox.store.guarded_writes import fenced_update
    from tests.testapp.models import Profile

    prefix, fenced = sys.argv[1], sys.argv[2] == "1"
    held: dict[int, LeaseLock] = {}
    print("ready", flush=True)
    for line in sys.stdin:
        command, user, *rest = line.split()
        user_id = int(user)
        if command == "acquire":
            lock = LeaseLock(
                redis_state.client(), f"profile:{user_id}", ttl=float(rest[0]), prefix=prefix
            )
            held[user_id] = lock
            print(f"held {lock.acquire()}", flush=True)
        elif command == "write":
            lock = held.pop(user_id)
            rows = Profile.objects.filter(user_id=user_id)
            assert lock.fence is not None
            try:
                if fenced:
                    fenced_update(rows, token=lock.fence, data="stale")
                else:
                    rows.update(data="stale", fencing_token=lock.fence)
            except StaleFencingToken:
                print("refused", flush=True)
                continue
            print(f"accepted {lock.fence}", flush=True)


if __name__ == "__main__":
    main()
