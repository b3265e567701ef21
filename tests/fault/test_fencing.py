"""Fault test: a lock holder paused past its TTL wakes up and writes (GC pause, SIGSTOP).

Each round: A takes the lock (short TTL) and pauses past it; B takes the expired lock
with a larger fencing token and writes; A wakes and writes. With fencing the database
refuses A's write every time; the negative control (a plain update) lets A's stale
write overwrite B's in every round, which shows the check can fail.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter as Tally

import pytest
import redis

from celery_explicit.errors import StaleFencingToken
from celery_explicit.locks import LeaseLock
from django_outbox.store.guarded_writes import fenced_update
from tests.testapp.models import Profile

pytestmark = pytest.mark.django_db(transaction=True)

ROUNDS = 20


def one_round(client: redis.Redis, prefix: str, user_id: int, *, fenced: bool) -> str:
    Profile.objects.create(user_id=user_id, data="initial")
    rows = Profile.objects.filter(user_id=user_id)
    a = LeaseLock(client, f"profile:{user_id}", ttl=0.05, prefix=prefix)
    b = LeaseLock(client, f"profile:{user_id}", ttl=5.0, prefix=prefix)
    fence_a = a.acquire()
    time.sleep(0.08)  # A pauses past its TTL
    fence_b = b.acquire()  # B gets the expired lock
    assert fence_b > fence_a
    if fenced:
        fenced_update(rows, token=fence_b, data="B")
    else:
        rows.update(data="B")
    b.release()
    # A wakes up, unaware, and writes its (stale) rebuild.
    try:
        if fenced:
            fenced_update(rows, token=fence_a, data="A")
        else:
            rows.update(data="A")
    except StaleFencingToken:
        return "stale write refused"
    return "stale write applied" if rows.get().data == "A" else "newer write kept"


@pytest.mark.parametrize(
    ("fenced", "expected"),
    [
        (True, {"stale write refused": ROUNDS}),
        (False, {"stale write applied": ROUNDS}),  # negative control
    ],
    ids=["fenced", "negative-control"],
)
def test_paused_holder_cannot_overwrite_a_newer_write(redis_client, fenced, expected) -> None:
    prefix = f"explicit-test:{uuid.uuid4().hex[:8]}:"
    outcomes = Tally(
        one_round(redis_client, prefix, user_id, fenced=fenced) for user_id in range(ROUNDS)
    )
    assert outcomes == Tally(expected)
    if fenced:
        assert set(Profile.objects.values_list("data", flat=True)) == {"B"}
