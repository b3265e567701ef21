"""The worker's lease keeper on a real kombu Redis channel: when a message gets its lease.

A message kombu has just delivered is scored with its delivery time in the unacked
index, so until the keeper leases it, it depends on the global visibility timeout. The
keeper gives each new message its lease at its first look (every 0.1 s), not at the
next heartbeat (T / 4, up to 10 s). A worker killed between the two lost the job for
the whole global timeout (seen: tests/fault/test_lease.py's kill test, with the kill
right after the job started).

The message, the channel and the Redis sorted set are real; the worker's request is a
plain object carrying what the keeper reads from Celery's (task, message, pid, id).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery.worker import state
from django.conf import settings
from kombu import Connection, Queue

from celery_explicit.message_lease import record_key
from celery_explicit.message_lease_keeper import LeaseKeeper
from tests.testapp.tasks import SlowShip

BACKSTOP = 60.0  # the global visibility timeout of this test's channel


@pytest.fixture(params=["", "kombu-prefix:"], ids=["no-global-prefix", "global_keyprefix"])
def held(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[Any]:
    """One message delivered and not acked, on a channel with its own unacked keys.

    Run twice: once as kombu names its keys by default, once with the transport's
    ``global_keyprefix``, under which kombu keeps its index at ``<prefix><index>``:
    the keeper must move that entry, not one at an unprefixed name.
    """
    suffix = uuid.uuid4().hex[:8]
    global_prefix = f"{request.param}{suffix}:" if request.param else ""
    options = {
        "visibility_timeout": BACKSTOP,
        "unacked_key": f"explicit-test:unacked:{suffix}",
        "unacked_index_key": f"explicit-test:unacked-index:{suffix}",
        "unacked_mutex_key": f"explicit-test:unacked-mutex:{suffix}",
        "global_keyprefix": global_prefix,
    }
    with Connection(settings.REDIS_URL, transport_options=options) as connection:
        channel = connection.default_channel
        queue = Queue(f"q-{suffix}", channel=channel)
        queue.declare()
        connection.Producer().publish({"order": 1}, routing_key=queue.name)
        message = queue.get(no_ack=False)
        assert message is not None
        job = SimpleNamespace(
            task=SlowShip(), message=message, worker_pid=os.getpid(), id=f"job-{suffix}"
        )
        reserved = [job]
        monkeypatch.setattr(state, "reserved_requests", reserved)
        monkeypatch.setattr(state, "scheduled_requests", [])
        keeper = LeaseKeeper(SimpleNamespace())
        keeper._redis_broker = True  # what start() finds on a Redis transport
        index = global_prefix + options["unacked_index_key"]  # the name on the server
        assert redis_client.zscore(index, message.delivery_tag) is not None  # kombu's place
        yield SimpleNamespace(
            keeper=keeper,
            parent=SimpleNamespace(connection=connection),
            request=job,
            index=index,
            tag=message.delivery_tag,
            message=message,
            reserved=reserved,
        )
        if not message.acknowledged:
            message.ack()
        keys = [global_prefix + v for v in options.values() if isinstance(v, str) and v]
        redis_client.delete(global_prefix + queue.name, record_key(job.id), *keys)


def test_a_new_message_gets_its_lease_at_the_first_look(held, redis_client) -> None:
    delivered = redis_client.zscore(held.index, held.tag)
    assert delivered is not None and abs(delivered - time.time()) < 5  # kombu's score
    before = time.time()
    held.keeper.first_leases(held.parent)
    # Scored so the sweep puts it back T (SlowShip: 2 s) from now, not 60 s from its
    # delivery: deadline - backstop.
    score = redis_client.zscore(held.index, held.tag)
    assert before + 2 - BACKSTOP - 0.5 < score < time.time() + 2 - BACKSTOP + 0.5
    record = redis_client.hgetall(record_key(held.request.id))
    assert record[b"extensions"] == b"1"
    assert record[b"owner"].endswith(f":{os.getpid()}".encode())
    assert 0 < redis_client.pttl(record_key(held.request.id)) <= 2000


def test_a_leased_message_is_left_to_the_heartbeat(held, redis_client) -> None:
    held.keeper.first_leases(held.parent)
    held.keeper.first_leases(held.parent)  # nothing new: nothing sent
    assert redis_client.hget(record_key(held.request.id), "extensions") == b"1"
    held.keeper.tick(held.parent)  # the heartbeat extends every held message
    assert redis_client.hget(record_key(held.request.id), "extensions") == b"2"


def test_a_message_acked_before_the_look_is_not_leased_nor_looked_at_again(
    held, redis_client, monkeypatch
) -> None:
    held.message.ack()  # the job ended between the listing and the lease
    held.keeper.first_leases(held.parent)
    assert not redis_client.exists(record_key(held.request.id))
    # Remembered as gone: the next looks send nothing for it (it would otherwise be
    # sent again ten times a second for as long as Celery lists the request).
    sent: list[object] = []
    monkeypatch.setattr(
        redis.client.Pipeline, "execute", lambda self, *a, **k: sent.append(self) or []
    )
    held.keeper.first_leases(held.parent)
    assert sent == []


def test_an_old_delivery_never_deletes_the_record_of_a_newer_one(held, redis_client) -> None:
    # A retry of the same job is a newer delivery with the same task id: its lease
    # record must survive the old delivery's last look.
    record = record_key(held.request.id)
    redis_client.hset(record, mapping={"tag": "newer-delivery", "extensions": 3})
    held.message.ack()
    held.keeper.first_leases(held.parent)
    assert redis_client.hget(record, "tag") == b"newer-delivery"


def test_other_tasks_messages_are_left_alone(held, redis_client) -> None:
    held.request.task = object()  # a plain Celery task's request: no lease of ours
    held.keeper.first_leases(held.parent)
    assert not redis_client.exists(record_key(held.request.id))
    assert abs(redis_client.zscore(held.index, held.tag) - time.time()) < 5  # kombu's


def test_a_scheduled_message_gets_its_lease_too(held, redis_client, monkeypatch) -> None:
    # A retry with a countdown waits in the worker's memory until its time; if the
    # worker dies meanwhile, its message must come back within its lease too.
    held.reserved.clear()
    monkeypatch.setattr(state, "scheduled_requests", [held.request])
    held.keeper.first_leases(held.parent)
    assert redis_client.hget(record_key(held.request.id), "extensions") == b"1"
