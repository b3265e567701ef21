"""A message leaves its queue only into the broker's record of its delivery (Redis).

kombu's Redis consumer takes a message with ``BRPOP`` and records it as
unacknowledged (``QoS.append``: the ``unacked`` hash and ``unacked_index``) in a second
command, once the reply has reached the worker and been parsed. Between the two the
message is nowhere on the server: a worker SIGKILLed there, or whose connection drops
with the reply in flight, loses it for good. The short kill storm
(``tests/chaos/test_kills.py``) lost a job this way about once in 20 runs, each with
eight whole-worker kills.

Here one script takes the message and records it in the same step (``FETCH``): off
the first non-empty queue key, in kombu's order (every queue's plain key, then each
priority step's), into the ``unacked`` entry kombu would write, the index scored with
the task's lease (``celery_explicit.message_lease``; the delivery time, as kombu, for a task
without one) and the delivery's holder. A worker killed at any moment leaves the
message in its queue or in ``unacked``, where a sweep finds it. One round trip, as the
``BRPOP`` was: the lease's own write on delivery goes away with it.

A script cannot block, and Redis has no command that waits on several lists without
taking from one. So when every queue is empty the channel waits with ``BLMOVE key key
RIGHT RIGHT``: moving a list's last element onto its own end changes nothing, and
returns as soon as that list holds a message (Redis 6.2+; older servers keep
kombu's ``BRPOP``, with a warning). It waits on one queue's plain key at a time, for
``brpop_timeout`` (kombu's ``polling_interval``, 1 s) shared among the queues, and
fetches again after each wait: on an idle worker a message at a priority step or on
another queue than the one waited on is found within about ``brpop_timeout``; a busy
worker fetches without waiting.

A message with no delivery tag (not a kombu envelope: nothing could ack or restore
it) is moved to ``explicit:unreadable:<queue>`` on the broker, counted in
``explicit_unreadable_messages_total`` and logged, not dropped: kombu raises on it, and
the message is gone.

Replaced on the consumer's channel only (``_brpop_start``, ``_brpop_read`` and the
poller's handler), as ``message_lease_transport.lease_on_delivery`` replaces its
``QoS.append``; ``tests/integration/test_atomic_fetch.py`` and
``test_upstream_seams.py`` fail if kombu's seams move. ``EXPLICIT_ATOMIC_FETCH=0`` keeps
kombu's ``BRPOP`` (the negative control of ``tests/fault/test_atomic_fetch.py``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

from celery_explicit import job_log, metrics, redis_scripts
from celery_explicit.conf import settings
from celery_explicit.redis_scripts import SERVER_NOW_MS, Script

logger = job_log.get_logger("celery_explicit.atomic_fetch")

#: Where a message without a delivery tag is kept, beside kombu's keys on the broker.
UNREADABLE_PREFIX = "explicit:unreadable:"
#: The shortest wait on one queue (seconds), however many queues share the timeout.
SHORTEST_WAIT = 0.05

# KEYS[1..n]      - the queue keys, in the order kombu's BRPOP names them
# KEYS[n+1..2n]   - where each key's unreadable message goes (explicit:unreadable:<queue>)
# KEYS[2n+1]      - kombu's unacked_index   KEYS[2n+2] - kombu's unacked hash
# KEYS[2n+3]      - the delivery holders
# ARGV[1] - n     ARGV[2] - the global visibility timeout in ms (the backstop)
# ARGV[3] - this worker's holder id, or "" for none
# ARGV[4..n+3]    - each key's queue name (the routing key of a message that names none)
# ARGV[n+4..]     - pairs: task name, its lease in ms
# return nil when every queue is empty; {i, message, 1, tag} when the message of KEYS[i] was
# taken and recorded as kombu's QoS.append records it (score: the lease's deadline less
# the backstop, or the server's time for a task without a lease); {i, "", 0, ""} when it
# named no delivery tag and went to KEYS[n+i]. A script's writes before an error stay,
# so nothing here may fail after the RPOP: the decode is protected.
FETCH = Script(
    "atomic_fetch",
    SERVER_NOW_MS
    + """
local n = tonumber(ARGV[1])
for i = 1, n do
    local item = redis.call('rpop', KEYS[i])
    if item then
        local ok, message = pcall(cjson.decode, item)
        local tag, exchange, routing_key, task
        if ok and type(message) == 'table' then
            local properties = message['properties']
            if type(properties) == 'table' then
                tag = properties['delivery_tag']
                local info = properties['delivery_info']
                if type(info) == 'table' then
                    exchange = info['exchange']
                    routing_key = info['routing_key']
                end
            end
            local headers = message['headers']
            if type(headers) == 'table' then
                task = headers['task']
            end
        end
        if type(tag) ~= 'string' then
            redis.call('lpush', KEYS[n + i], item)
            return {i, '', 0, ''}
        end
        if type(exchange) ~= 'string' or type(routing_key) ~= 'string' then
            exchange = ''
            routing_key = ARGV[3 + i]
        end
        local lease
        if type(task) == 'string' then
            for j = n + 4, #ARGV, 2 do
                if ARGV[j] == task then
                    lease = tonumber(ARGV[j + 1])
                    break
                end
            end
        end
        local score = now_ms / 1000
        if lease then
            score = (now_ms + lease - tonumber(ARGV[2])) / 1000
        end
        redis.call('zadd', KEYS[2 * n + 1], score, tag)
        redis.call('hset', KEYS[2 * n + 2], tag,
            '[' .. item .. ',' .. cjson.encode(exchange) .. ',' .. cjson.encode(routing_key) .. ']')
        if lease and ARGV[3] ~= '' then
            redis.call('hset', KEYS[2 * n + 3], tag, ARGV[3])
        end
        return {i, item, 1, tag}
    end
end
return nil
""",
)


@dataclass
class _Fetch:
    """One consumer channel's fetch: what the script needs besides the queue keys, and
    what was sent last (the reply is read by the poller later)."""

    client: Any  # a pooled client of the same broker, to load the script
    head: tuple[str, str]
    tail_keys: list[str]  # unacked_index, unacked, holders
    args: list[Any]  # backstop, holder
    lease_args: list[Any]  # task name, lease ms, ...
    waiting: bool = False
    sent: str = ""  # "fetch" or "wait"
    names: list[str] = field(default_factory=list)
    queue: str = ""


def install(
    channel: Any,
    *,
    client: Any,
    leases: Mapping[str, float],
    backstop: float,
    holder: str,
    index_key: str,
    unacked_key: str,
    holders_key: str,
) -> bool:
    """Make the consumer ``channel`` take each message with ``FETCH``; False (kombu's
    ``BRPOP`` kept) when switched off or the server has no ``BLMOVE``."""
    if not settings.atomic_fetch:
        return False
    if not _has_blmove(client):
        logger.warning(
            "Redis %s has no BLMOVE (6.2+): messages are taken with kombu's BRPOP, and "
            "a worker killed between the BRPOP and its record of the delivery loses "
            "that message",
            client.info("server").get("redis_version", "?"),
        )
        return False
    channel.explicit_fetch = _Fetch(
        client=client,
        head=redis_scripts.prepared(client, FETCH),
        tail_keys=[index_key, unacked_key, holders_key],
        args=[int(backstop * 1000), holder],
        lease_args=[x for name, lease in leases.items() for x in (name, int(lease * 1000))],
    )
    channel._brpop_start = MethodType(_start, channel)
    channel._brpop_read = MethodType(_read, channel)
    # The poller calls the handler Channel.__init__ bound, not the attribute.
    channel.handlers["BRPOP"] = channel._brpop_read
    return True


def recorded_by_fetch(channel: Any) -> bool:
    """True (once) when the message being delivered on ``channel`` was recorded by the
    fetch that took it: ``QoS.append`` then keeps only its in-memory part."""
    if getattr(channel, "explicit_fetched", False):
        channel.explicit_fetched = False
        return True
    return False


def _has_blmove(client: Any) -> bool:
    version = str(client.info("server").get("redis_version", "0"))
    parts = [int(p) for p in version.split(".")[:2] if p.isdigit()]
    return tuple(parts) >= (6, 2)


def _start(channel: Any, timeout: float | None = None) -> None:
    """``Channel._brpop_start``: send a fetch, or after an empty one a wait."""
    fetch: _Fetch = channel.explicit_fetch
    queues = channel._queue_cycle.consume(len(channel.active_queues))
    if not queues:
        return
    prefix = str(getattr(channel, "global_keyprefix", "") or "")
    connection = channel.client.connection
    if fetch.waiting:
        key = prefix + channel._q_for_pri(queues[0], 0)
        total = channel.brpop_timeout if timeout is None else timeout
        wait = max(SHORTEST_WAIT, float(total or 1) / len(queues))
        fetch.sent, fetch.queue = "wait", queues[0]
        command: tuple[Any, ...] = ("BLMOVE", key, key, "RIGHT", "RIGHT", wait)
    else:
        names = [channel._q_for_pri(q, pri) for pri in channel.priority_steps for q in queues]
        dests = [name.rsplit(channel.sep, 1)[0] for name in names]
        keys = [prefix + name for name in names]
        unreadable = [prefix + UNREADABLE_PREFIX + dest for dest in dests]
        fetch.sent, fetch.names = "fetch", dests
        all_keys = keys + unreadable + fetch.tail_keys
        command = (
            *fetch.head,
            len(all_keys),
            *all_keys,
            len(keys),
            *fetch.args,
            *dests,
            *fetch.lease_args,
        )
    channel._in_poll = connection
    # kombu 5.7's health check drops a connection whose reply is overdue; both replies
    # come within brpop_timeout.
    channel._brpop_sent_at = time.monotonic()
    connection.send_command(*command)


def _read(channel: Any, **options: Any) -> bool:
    """``Channel._brpop_read``: deliver what a fetch took, or after a wait fetch next."""
    from queue import Empty

    from kombu.utils.encoding import bytes_to_str
    from kombu.utils.json import loads
    from redis.exceptions import ResponseError

    fetch: _Fetch = channel.explicit_fetch
    try:
        try:
            reply = channel.client.parse_response(
                channel.client.connection, "BLMOVE" if fetch.sent == "wait" else "FCALL", **options
            )
        except channel.connection_errors:
            # As kombu: disconnect, so that the next round connects again.
            channel.client.connection.disconnect()
            raise
        except ResponseError as exc:
            if fetch.sent == "fetch" and redis_scripts.missing(exc):
                fetch.head = redis_scripts.prepared(fetch.client, FETCH, reload=True)
                raise Empty() from None
            raise
        if fetch.sent == "wait":
            fetch.waiting = False
            if reply is None:  # waited out: the next wait is on the next queue
                channel._queue_cycle.rotate(fetch.queue)
            raise Empty()
        if not reply:
            fetch.waiting = True
            raise Empty()
        index, item, recorded, tag = reply
        dest = fetch.names[int(index) - 1]
        if not int(recorded):
            _unreadable(dest, "names no delivery tag")
            raise Empty()
        channel._queue_cycle.rotate(dest)
        try:
            payload = loads(bytes_to_str(item))
        except (ValueError, RecursionError) as exc:  # the server's JSON reader took it
            # (lua-cjson nests 1,000 deep, Python 3.11's reader less), Python's did not
            _set_aside(channel, fetch, dest, item, bytes_to_str(tag))
            _unreadable(dest, f"cannot be read ({exc})")
            raise Empty() from None
        if not isinstance(payload, dict) or not isinstance(payload.get("body"), str | bytes):
            # kombu's envelope carries its body as text (JSON or base64): anything else
            # cannot be decoded by any consumer, whichever Python read the envelope.
            _set_aside(channel, fetch, dest, item, bytes_to_str(tag))
            _unreadable(dest, "has a body that is not text")
            raise Empty()
        channel.explicit_fetched = True
        try:
            channel.connection._deliver(payload, dest)
        finally:
            channel.explicit_fetched = False
        return True
    finally:
        channel._in_poll = None
        flush = getattr(channel, "_flush_brpop_reauth", None)
        if flush is not None:  # kombu 5.7: the connection is idle now
            flush()


def _unreadable(queue: str, why: str) -> None:
    metrics.unreadable_messages.labels(queue).inc()
    logger.error(
        "a message on queue %r %s (not a kombu message): moved to %r on the broker, not run",
        queue,
        why,
        UNREADABLE_PREFIX + queue,
    )


def _set_aside(channel: Any, fetch: _Fetch, queue: str, item: bytes, tag: str) -> None:
    """Move a recorded message Python cannot read from ``unacked`` to the queue's
    unreadable list, in one transaction: kept, and never restored to fail again."""
    prefix = str(getattr(channel, "global_keyprefix", "") or "")
    index_key, unacked_key, holders_key = fetch.tail_keys
    pipe = fetch.client.pipeline(transaction=True)
    pipe.lpush(prefix + UNREADABLE_PREFIX + queue, item)
    pipe.zrem(index_key, tag)
    pipe.hdel(unacked_key, tag)
    pipe.hdel(holders_key, tag)
    pipe.execute()
