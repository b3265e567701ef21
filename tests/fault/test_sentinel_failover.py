"""Fault test: the state store behind Sentinel, through a failover Sentinel performs.

Each round: a private primary, its replica (replicating through a proxy) and three
Sentinels. The state store's client is made from Celery's Sentinel URL, as
``EXPLICIT_REDIS_URL`` would give it. A lock is taken and released (the replica has
its counter), the replication link then loses everything, holder A takes the lock,
the primary is SIGKILLed and the Sentinels promote the replica. The same client then
takes the lock for B as soon as it can: it must reach the promoted replica by itself,
B's token must be larger than A's and A's stale write refused. The time from the kill
to B's lock is the state store's outage.

Negative control: the same through the acquisition that seeded its counter from the
clock only when it was missing: the promoted replica hands out A's token again.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from pathlib import Path

import pytest
import redis

from celery_explicit import locks, redis_state
from celery_explicit.locks import LeaseLock
from tests.support.replication import COUNTER_ONLY, stale_write, tokens
from tests.support.scale import scaled
from tests.support.sentinel import DOWN_AFTER_MS, SentinelGroup
from tests.testapp.models import Profile

pytestmark = pytest.mark.django_db(transaction=True)

ROUNDS = scaled(2, 10)
#: Sentinel's detection (down-after) and election, with room for a loaded machine.
OUTAGE_BOUND = 15.0


def one_round(data_dir: Path, user_id: int, outages: list[float]) -> tuple[str, str]:
    group = SentinelGroup(data_dir)
    try:
        client = redis_state.new_client(group.url, keep_one=True)
        Profile.objects.create(user_id=user_id, data="initial")
        rows = Profile.objects.filter(user_id=user_id)
        name = f"profile:{user_id}"
        first = LeaseLock(client, name, ttl=60.0, prefix="sentinel:")
        first.acquire()
        first.release()
        group.wait_in_sync()

        group.sever()
        fence_a = LeaseLock(client, name, ttl=60.0, prefix="sentinel:").acquire()
        group.kill_primary()
        killed = time.monotonic()
        b = LeaseLock(client, name, ttl=60.0, prefix="sentinel:")
        while True:
            try:
                fence_b = b.acquire()
                break
            except redis.ConnectionError:
                # The old primary is gone and the Sentinels have not promoted yet.
                assert time.monotonic() - killed < OUTAGE_BOUND, "no primary again in time"
                time.sleep(0.05)
        outages.append(time.monotonic() - killed)
        # B's lock is on the promoted replica. (Read there: the Sentinel the client asked
        # may have learnt of the promotion before the one master_port() asks.)
        assert redis.Redis(port=group.replica.port).exists(b.key) == 1

        return tokens(fence_a, fence_b), stale_write(rows, fence_a, fence_b)
    finally:
        group.stop()


@pytest.mark.parametrize("control", [False, True], ids=["clock-floor", "negative-control"])
def test_a_sentinel_failover_keeps_fencing_and_the_client_follows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, control: bool
) -> None:
    if control:
        monkeypatch.setattr(locks, "ACQUIRE", COUNTER_ONLY)
    outages: list[float] = []
    rounds = 1 if control else ROUNDS
    outcomes = Tally(one_round(tmp_path / f"round-{i}", 9_500 + i, outages) for i in range(rounds))
    if control:
        assert outcomes == Tally({("token handed out twice", "stale write applied"): rounds})
    else:
        assert outcomes == Tally({("B's token larger", "stale write refused"): rounds})
    # Detection takes down-after-milliseconds at least: the client waited for it.
    assert all(DOWN_AFTER_MS / 1000 <= outage < OUTAGE_BOUND for outage in outages), outages
    print(f"state store outage per failover: {', '.join(f'{o:.2f} s' for o in outages)}")


@pytest.mark.parametrize(
    ("url", "options", "error"),
    [
        ("sentinel://127.0.0.1:26379/0", {}, "needs one master name"),
        ("sentinel://127.0.0.1:26379/0?master_name=a;sentinel://h:1?master_name=b", {}, "got"),
        ("sentinel://127.0.0.1:26379;redis://127.0.0.1:6379", {}, "is not a sentinel://"),
    ],
)
def test_a_sentinel_url_without_one_master_name_is_refused(url, options, error) -> None:
    with pytest.raises(ValueError, match=error):
        redis_state.SentinelTarget.parse(url, options)


def test_the_master_name_comes_from_the_transport_options_when_the_url_has_none() -> None:
    target = redis_state.SentinelTarget.parse(
        "sentinel://:pw@10.0.0.1:26379;sentinel://10.0.0.2/3",
        {"master_name": "mymaster", "sentinel_kwargs": {"password": "s"}},
    )
    assert target.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26379))
    assert (target.master_name, target.db, target.password) == ("mymaster", 3, "pw")
    assert target.sentinel_kwargs == {"password": "s"}
