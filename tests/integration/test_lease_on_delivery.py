"""A message gets its lease in the write that records it as delivered.

On a real kombu Redis channel: ``lease_on_delivery`` replaces the consumer's
``QoS.append``, which must keep writing exactly what kombu writes (the unacked entry a
restore reads back, the in-memory record a warm shutdown restores from), with the
index score already the task's deadline instead of the delivery time. Run with and
without the transport's ``global_keyprefix``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from django.conf import settings
from kombu import Connection, Queue

from celery_explicit.message_lease_transport import lease_on_delivery
from celery_explicit.redis_scripts import server_time

BACKSTOP = 60.0
LEASED = "tests.leased"  # a task name given a lease below
LEASE = 2.0


@pytest.fixture(params=["", "kombu-prefix:"], ids=["no-global-prefix", "global_keyprefix"])
def channel(redis_client: redis.Redis, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A channel with unacked keys and a queue of its own."""
    suffix = uuid.uuid4().hex[:8]
    prefix = f"{request.param}{suffix}:" if request.param else ""
    options = {
        "visibility_timeout": BACKSTOP,
        "unacked_key": f"explicit-test:unacked:{suffix}",
        "unacked_index_key": f"explicit-test:unacked-index:{suffix}",
        "unacked_mutex_key": f"explicit-test:unacked-mutex:{suffix}",
        "global_keyprefix": prefix,
    }
    with Connection(settings.REDIS_URL, transport_options=options) as connection:
        chan = connection.default_channel
        queue = Queue(f"q-{suffix}", channel=chan)
        queue.declare()
        yield SimpleNamespace(
            channel=chan,
            queue=queue,
            producer=connection.Producer(),
            index=prefix + options["unacked_index_key"],
            unacked=prefix + options["unacked_key"],
            queue_key=prefix + queue.name,
        )
        keys = [prefix + v for v in options.values() if isinstance(v, str) and v]
        redis_client.delete(prefix + queue.name, *keys)


def deliver(channel: Any, task: str) -> Any:
    channel.producer.publish({"task": task}, routing_key=channel.queue.name, headers={"task": task})
    message = channel.queue.get(no_ack=False)  # basic_get: QoS.append, as on BRPOP
    assert message is not None
    return message


def test_a_leased_task_s_message_is_scored_with_its_deadline_at_delivery(
    channel, redis_client
) -> None:
    lease_on_delivery(channel.channel.qos, {LEASED: LEASE})
    before = server_time(redis_client)
    message = deliver(channel, LEASED)
    score = redis_client.zscore(channel.index, message.delivery_tag)
    # deadline - backstop, on the server's clock (to the millisecond): the sweep puts
    # it back LEASE from now, not BACKSTOP.
    after = server_time(redis_client)
    assert before + LEASE - BACKSTOP - 0.001 <= score <= after + LEASE - BACKSTOP + 0.001
    # The unacked entry is what kombu's own method writes: [payload, exchange, key].
    payload, exchange, routing_key = json.loads(
        redis_client.hget(channel.unacked, message.delivery_tag)
    )
    assert payload["headers"]["task"] == LEASED
    assert (exchange, routing_key) == (
        message.delivery_info["exchange"],
        message.delivery_info["routing_key"],
    )


def test_another_task_s_message_keeps_kombu_s_score(channel, redis_client) -> None:
    lease_on_delivery(channel.channel.qos, {LEASED: LEASE})
    message = deliver(channel, "tests.plain")
    score = redis_client.zscore(channel.index, message.delivery_tag)
    assert abs(score - time.time()) < 5  # its delivery time


def test_both_write_the_same_unacked_entry(channel, redis_client) -> None:
    """The seam: kombu's method and ours write one entry shape, which restore reads."""
    plain = deliver(channel, LEASED)  # kombu's own method: nothing installed yet
    lease_on_delivery(channel.channel.qos, {LEASED: LEASE})
    leased = deliver(channel, LEASED)
    kombu_entry = json.loads(redis_client.hget(channel.unacked, plain.delivery_tag))
    our_entry = json.loads(redis_client.hget(channel.unacked, leased.delivery_tag))
    for entry in (our_entry, kombu_entry):
        entry[0]["properties"].pop("delivery_tag")  # the only difference: another delivery
    assert our_entry == kombu_entry


def test_the_sweep_puts_it_back_when_its_lease_runs_out(channel, redis_client) -> None:
    # 2 s: the first sweep must come before the lease runs out, even on a loaded machine.
    lease_on_delivery(channel.channel.qos, {LEASED: 2.0})
    leased = deliver(channel, LEASED)
    plain = deliver(channel, "tests.plain")
    channel.channel.qos.restore_visible(interval=1)
    assert redis_client.llen(channel.queue_key) == 0  # its lease still runs
    time.sleep(2.3)
    channel.channel.qos.restore_visible(interval=1)
    # Back on its queue, whole; the other message waits for the 60 s backstop.
    assert redis_client.zscore(channel.index, leased.delivery_tag) is None
    assert redis_client.zscore(channel.index, plain.delivery_tag) is not None
    again = channel.queue.get(no_ack=True)
    assert again is not None and again.headers["task"] == LEASED
    assert again.payload == {"task": LEASED}
    plain.ack()


def test_a_warm_shutdown_puts_back_what_it_holds_and_an_ack_removes_it(
    channel, redis_client
) -> None:
    # Our method records the delivery in memory as kombu's does: restore_unacked (a
    # warm shutdown) reads that record; ack removes both entries.
    lease_on_delivery(channel.channel.qos, {LEASED: LEASE})
    acked = deliver(channel, LEASED)
    acked.ack()
    assert redis_client.zscore(channel.index, acked.delivery_tag) is None
    assert not redis_client.hexists(channel.unacked, acked.delivery_tag)
    held = deliver(channel, LEASED)
    channel.channel.qos.restore_unacked()
    assert redis_client.zscore(channel.index, held.delivery_tag) is None
    assert redis_client.llen(channel.queue_key) == 1
