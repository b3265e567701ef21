"""The fetch that takes a message off its queue also records its delivery.

On a real kombu Redis channel consuming through its poller (``drain_events``, the
path a worker's event loop takes): ``celery_explicit.atomic_fetch`` replaces the
channel's ``BRPOP`` with one script, which must record exactly what kombu's
``QoS.append`` records (the unacked entry a restore reads back), scored with the
task's lease, with its holder; take from every queue and priority step a ``BRPOP``
would; set aside what is not a kombu message instead of dropping it; and survive the
server losing its functions. A private ``redis-server``, so its command counts are
this test's alone. Run with and without the transport's ``global_keyprefix``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Queue
from prometheus_client import REGISTRY

from celery_explicit import atomic_fetch
from celery_explicit.message_lease import holder_id
from celery_explicit.message_lease_transport import lease_on_delivery
from celery_explicit.redis_scripts import server_time
from tests.support.servers import PrivateRedis

BACKSTOP = 60.0
LEASED = "tests.leased"
LEASE = 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    private = PrivateRedis(Path(tmp_path_factory.mktemp("fetch")), durable=False).start()
    yield private
    private.kill()


@pytest.fixture(params=["", "kombu-prefix:"], ids=["no-global-prefix", "global_keyprefix"])
def broker(server: PrivateRedis, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A connection, two queues and a consumer of both, on the private server."""
    prefix = request.param
    options = {"visibility_timeout": BACKSTOP, "global_keyprefix": prefix}
    client = server.client()
    with Connection(server.url, transport_options=options) as connection:
        channel = connection.default_channel
        suffix = uuid.uuid4().hex[:8]
        queues = [Queue(f"a-{suffix}", channel=channel), Queue(f"b-{suffix}", channel=channel)]
        for queue in queues:
            queue.declare()
        received: list[Any] = []
        yield SimpleNamespace(
            connection=connection,
            channel=channel,
            queues=queues,
            producer=connection.Producer(),
            received=received,
            consumer=Consumer(channel, queues, callbacks=[lambda _b, m: received.append(m)]),
            client=client,
            prefix=prefix,
            index=prefix + "unacked_index",
            unacked=prefix + "unacked",
            holders=prefix + "unacked_holder",
        )
    client.flushall()


def publish(broker: Any, task: str, queue: int = 0, **options: Any) -> None:
    name = broker.queues[queue].name
    broker.producer.publish({"task": task}, routing_key=name, headers={"task": task}, **options)


def receive(broker: Any, count: int = 1) -> list[Any]:
    """Drain events until ``count`` messages more have been delivered."""
    want = len(broker.received) + count
    with broker.consumer:
        for _ in range(50):
            if len(broker.received) >= want:
                break
            try:
                broker.connection.drain_events(timeout=0.5)
            except TimeoutError:
                continue
    assert len(broker.received) >= want, f"{len(broker.received)} of {want} received"
    return broker.received[want - count : want]


def calls(client: redis.Redis, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def install(broker: Any) -> None:
    lease_on_delivery(broker.channel.qos, {LEASED: LEASE})
    assert broker.channel.explicit_fetch is not None


def test_the_fetch_records_what_kombu_records_scored_with_the_lease(broker) -> None:
    client = broker.client
    install(broker)
    brpops = calls(client, "brpop")
    before = server_time(client)
    publish(broker, LEASED)
    (message,) = receive(broker)
    after = server_time(client)
    tag = message.delivery_tag
    score = client.zscore(broker.index, tag)
    assert before + LEASE - BACKSTOP - 0.001 <= score <= after + LEASE - BACKSTOP + 0.001
    payload, exchange, routing_key = json.loads(client.hget(broker.unacked, tag))
    assert payload == message._raw  # the envelope, as kombu's own append stores it
    assert (exchange, routing_key) == (
        message.delivery_info["exchange"],
        message.delivery_info["routing_key"],
    )
    assert client.hget(broker.holders, tag).decode() == holder_id()
    assert calls(client, "brpop") == brpops  # taken by the script, not by a BRPOP
    # kombu's in-memory record is kept too: the ack removes the entries.
    message.ack()
    assert client.zscore(broker.index, tag) is None
    assert not client.hexists(broker.unacked, tag)


def test_a_task_without_a_lease_keeps_kombu_s_score_and_no_holder(broker) -> None:
    client = broker.client
    install(broker)
    publish(broker, "tests.plain")
    (message,) = receive(broker)
    score = client.zscore(broker.index, message.delivery_tag)
    assert abs(score - server_time(client)) < 5  # its delivery time
    assert not client.hexists(broker.holders, message.delivery_tag)


def test_the_fetch_takes_from_every_queue_and_priority_step(broker) -> None:
    install(broker)
    publish(broker, LEASED, queue=1)
    publish(broker, LEASED, queue=0, priority=9)
    messages = receive(broker, 2)
    assert sorted(m.delivery_info["routing_key"] for m in messages) == sorted(
        q.name for q in broker.queues
    )
    # Nothing is left anywhere but in unacked, until acked.
    client = broker.client
    steps = broker.channel.priority_steps
    keys = [broker.channel._q_for_pri(q.name, pri) for q in broker.queues for pri in steps]
    assert [client.llen(broker.prefix + key) for key in keys] == [0] * len(keys)
    for message in messages:
        message.ack()
    assert client.hlen(broker.unacked) == 0


def test_a_message_that_is_not_kombu_s_is_set_aside_and_the_next_one_delivered(
    broker,
) -> None:
    client = broker.client
    install(broker)
    queue = broker.queues[0].name
    key = broker.prefix + queue
    counted = REGISTRY.get_sample_value("explicit_unreadable_messages_total", {"queue": queue})
    not_json = b"not json"
    no_tag = b'{"properties": {}, "body": "x"}'
    # JSON to the server (lua-cjson reads 1,000 levels deep), but not a kombu message:
    # Python 3.11's reader stops short of that depth, 3.13's reads it and finds a body
    # that is not text. Either way: taken, recorded, then set aside from unacked.
    too_deep = (
        b'{"properties": {"delivery_tag": "t-too-deep"}, "body": ' + b"[" * 999 + b"]" * 999 + b"}"
    )
    client.lpush(key, not_json, no_tag, too_deep)
    publish(broker, LEASED)
    (message,) = receive(broker)
    assert message.headers["task"] == LEASED
    aside = client.lrange(broker.prefix + atomic_fetch.UNREADABLE_PREFIX + queue, 0, -1)
    assert sorted(aside) == sorted([not_json, no_tag, too_deep])
    assert not client.hexists(broker.unacked, "t-too-deep")
    assert client.zscore(broker.index, "t-too-deep") is None
    after = REGISTRY.get_sample_value("explicit_unreadable_messages_total", {"queue": queue})
    assert after - (counted or 0) == 3


def test_a_server_that_lost_its_functions_gets_them_again(broker) -> None:
    client = broker.client
    install(broker)
    publish(broker, LEASED)
    receive(broker)
    client.function_flush()
    publish(broker, LEASED)
    (message,) = receive(broker)  # the fetch met "function not found", loaded, fetched
    assert client.zscore(broker.index, message.delivery_tag) is not None


def test_switched_off_kombu_s_brpop_takes_the_message(broker, settings) -> None:
    settings.EXPLICIT_ATOMIC_FETCH = False
    client = broker.client
    lease_on_delivery(broker.channel.qos, {LEASED: LEASE})
    assert getattr(broker.channel, "explicit_fetch", None) is None
    brpops = calls(client, "brpop")
    publish(broker, LEASED)
    receive(broker)
    assert calls(client, "brpop") > brpops
