"""The message lease inside kombu's Redis transport: the methods it replaces, and why.

kombu's Redis transport writes, acks and sweeps its record of each unacknowledged
message (``unacked``, and ``unacked_index`` scored by delivery time) with methods of
its ``QoS`` that take no lease into account. In a worker with ExplicitTasks this
module replaces them (``celery_explicit.message_lease`` says what the lease is):

- ``lease_on_delivery``: the consumer's ``QoS.append`` records a delivered message
  already scored with its lease, in the same write, so there is no moment in which a
  dead worker leaves its job to the global timeout (with ``EXPLICIT_ATOMIC_FETCH``,
  ``celery_explicit.atomic_fetch`` writes that record in the fetch itself);
- its ``ack``, ``reject`` and ``restore_unacked``: a delivery a sweep restored keeps
  its tag, so each acts only while this worker holds the delivery
  (``EXPLICIT_DELIVERY_HOLDER``), never on the record of the copy another worker runs;
  and when this worker received the sweep's copy while it still held the first one
  (two copies, one tag, one holder), the first of their acks is withheld, so the
  record goes with the last;
- ``sweep_by_server_clock``: kombu's sweep (``restore_visible``) compares the scores
  with the Redis server's clock, which wrote them, not the sweeping host's.

Kept apart from the keeper's heartbeat: these run inside kombu, on every delivery, ack
and sweep, and each one names the kombu code it stands in for.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MethodType
from typing import Any

from celery_explicit import atomic_fetch, job_log, metrics
from celery_explicit.conf import settings
from celery_explicit.message_lease import (
    broker_client,
    holder_id,
    holders_key_of,
    unacked_index_key,
)
from celery_explicit.redis_scripts import SERVER_NOW_MS, Script, call, server_time
from celery_explicit.redis_state import text

logger = job_log.get_logger("celery_explicit.message_lease_transport")

# KEYS[1] - kombu's unacked_index   KEYS[2] - kombu's unacked hash
# KEYS[3] - the delivery holders
# ARGV[1] - delivery tag            ARGV[2] - the message as kombu records it
# ARGV[3] - its lease in ms
# ARGV[4] - the global visibility timeout in ms   ARGV[5] - holder id, or "" for none
# return 1. kombu's ``QoS.append`` writes the same two entries in one MULTI, scored
# with the worker's clock; here the score is the server's, as every sweep reads it.
ON_DELIVERY = Script(
    "message_lease_on_delivery",
    SERVER_NOW_MS
    + """
redis.call('zadd', KEYS[1], (now_ms + tonumber(ARGV[3]) - tonumber(ARGV[4])) / 1000, ARGV[1])
redis.call('hset', KEYS[2], ARGV[1], ARGV[2])
if ARGV[5] ~= '' then
    redis.call('hset', KEYS[3], ARGV[1], ARGV[5])
end
return 1
""",
)

# KEYS[1] - kombu's unacked_index   KEYS[2] - kombu's unacked hash
# KEYS[3] - the delivery holders
# ARGV[1] - delivery tag            ARGV[2] - this worker's holder id
# return 1 if the delivery's record was removed (this worker held it, or no holder
# was recorded), 0 if another worker holds that delivery now (nothing touched)
ACK = Script(
    "message_ack_if_held",
    """
local holder = redis.call('hget', KEYS[3], ARGV[1])
if holder and holder ~= ARGV[2] then
    return 0
end
redis.call('zrem', KEYS[1], ARGV[1])
redis.call('hdel', KEYS[2], ARGV[1])
redis.call('hdel', KEYS[3], ARGV[1])
return 1
""",
)


def lease_on_delivery(qos: Any, leases: Mapping[str, float]) -> None:
    """Give each message of a task in ``leases`` (name: its ``visibility_timeout``) its
    lease in the very write that records it as delivered, on kombu Redis ``qos``.

    kombu's ``QoS.append`` records a delivered message in one MULTI: ``ZADD
    unacked_index {tag: time()}`` and ``HSET unacked`` (kombu/transport/redis.py,
    ``QoS.append``, called by ``Channel.basic_consume``'s callback right after BRPOP:
    https://github.com/celery/kombu/blob/v5.5.0/kombu/transport/redis.py). Scored with
    its delivery time, the message would depend on the global timeout until the
    keeper's first look. The replacement writes the same two entries in the same MULTI,
    the score already ``now + T - visibility_timeout``: no moment in which a dead
    worker leaves the job to the global timeout. Other messages keep kombu's method.

    Replaced on the consumer's QoS object, as Celery replaces its ``can_consume``
    (celery/worker/consumer/tasks.py). tests/integration/test_lease_on_delivery.py
    fails if kombu's own method comes to write anything else.
    """
    qos.explicit_leases = dict(leases)
    # Off: no holder is recorded (nothing would remove it) and kombu's ack stays.
    qos.explicit_holder = holder_id() if settings.delivery_holder else ""
    # Deliveries of a tag this worker received while it still held an earlier copy of
    # it (``_ack_if_held``): their number of acks to withhold.
    qos.explicit_copies = {}
    qos.append = MethodType(_append_with_lease, qos)
    channel = qos.channel
    atomic_fetch.install(
        channel,
        client=broker_client(channel),
        leases=qos.explicit_leases,
        backstop=float(qos.visibility_timeout),
        holder=qos.explicit_holder,
        index_key=unacked_index_key(channel),
        unacked_key=str(getattr(channel, "global_keyprefix", "") or "") + str(qos.unacked_key),
        holders_key=holders_key_of(channel),
    )
    if qos.explicit_holder:
        qos.ack = MethodType(_ack_if_held, qos)
        qos.reject = MethodType(_reject_if_held, qos)
        qos.restore_unacked = MethodType(_restore_unacked_if_held, qos)


def _append_with_lease(qos: Any, message: Any, delivery_tag: str) -> None:
    """``QoS.append`` of a consumer with ``lease_on_delivery``."""
    from kombu.transport import redis as kombu_redis
    from kombu.utils.json import dumps

    if (
        qos.explicit_holder
        and delivery_tag in qos._delivered
        and delivery_tag not in qos._dirty
        and settings.lease_extend
    ):
        # A sweep's copy of a message this worker still holds (its process stopped past
        # the lease, say): two copies, one tag, one holder, so the holder record cannot
        # tell them apart. The first of their acks is withheld (``_ack_if_held``), the
        # live copy's lease kept by the heartbeat. (Without the heartbeat, the negative
        # control's switch, nothing would keep it: the record would be swept again and
        # again, each copy taking the job over from the one before; kombu's ack stays.)
        qos.explicit_copies[delivery_tag] = qos.explicit_copies.get(delivery_tag, 0) + 1

    if atomic_fetch.recorded_by_fetch(qos.channel):
        # Recorded, lease and holder with it, by the script that took the message off
        # its queue: what is left is kombu's in-memory record of the delivery.
        super(kombu_redis.QoS, qos).append(message, delivery_tag)
        return
    # Protocol 2 names the task in a header; a message without one keeps kombu's score
    # and gets its lease at the keeper's first look. The headers are the sender's: a
    # ``task`` that is not a str (a list is unhashable) or headers that are not a dict
    # are looked up no further, and the message goes through kombu's own method
    # unchanged (Celery then refuses it as a task).
    headers = message.headers
    name = headers.get("task") if isinstance(headers, dict) else None
    lease = qos.explicit_leases.get(name) if isinstance(name, str) else None
    if lease is None:
        # Not an ExplicitTask's: kombu's own score (this host's clock), outside our
        # promise, which the server-clock sweep then compares with the server's.
        type(qos).append(qos, message, delivery_tag)
        return
    backstop = float(qos.visibility_timeout)
    delivery = message.delivery_info
    raw = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
    channel = qos.channel
    unacked = str(getattr(channel, "global_keyprefix", "") or "") + str(qos.unacked_key)
    # The holder: which worker holds this delivery now. A copy restored by a sweep keeps
    # its tag, so the tag alone cannot tell the live copy from a stale one.
    call(
        broker_client(channel),
        ON_DELIVERY,
        [unacked_index_key(channel), unacked, holders_key_of(channel)],
        [
            delivery_tag,
            raw,
            int(lease * 1000),
            int(backstop * 1000),
            qos.explicit_holder,
        ],
    )
    # What kombu's method does next: the in-memory record of the delivery.
    super(kombu_redis.QoS, qos).append(message, delivery_tag)


_kombu_restore_visible: Any = None


def sweep_by_server_clock() -> None:
    """Make kombu's sweep (``QoS.restore_visible``) of every channel in this worker
    compare the scores with the Redis server's clock.

    kombu's sweep puts back every message scored below ``time() - visibility_timeout``
    with the sweeping host's clock, and the scores were written by other hosts: a
    sweeper whose clock runs ahead by more than a lease restores live jobs, one behind
    leaves dead workers' jobs waiting. Replaced on the class at ``worker_init``, not on
    the consumer's channel when its step starts: kombu sweeps once through whichever
    channel comes first as the consumer connects, before any consumer step runs (seen:
    a worker 40 s ahead took a live job at start). ``EXPLICIT_SERVER_CLOCK=0`` calls
    kombu's own.
    """
    from kombu.transport import redis as kombu_redis

    global _kombu_restore_visible
    if _kombu_restore_visible is None:
        _kombu_restore_visible = kombu_redis.QoS.restore_visible
        kombu_redis.QoS.restore_visible = _restore_visible  # type: ignore[method-assign,assignment]


def on_worker_init(sender: Any = None, **_: Any) -> None:
    """``worker_init``: the sweep reads the server's clock from the worker's first one
    (kombu sweeps as the consumer connects, before any consumer step starts)."""
    sweep_by_server_clock()


def _restore_visible(qos: Any, start: int = 0, num: int = 10, interval: int = 10) -> None:
    """``QoS.restore_visible`` with the server's clock: the same throttle (a scan every
    ``interval`` calls), the same mutex, the same restore by tag."""
    from kombu.transport.redis import Mutex, MutexHeld

    if not settings.server_clock:
        _kombu_restore_visible(qos, start, num, interval)
        return
    qos._vrestore_count += 1
    if (qos._vrestore_count - 1) % (interval or 1):
        return
    with qos.channel.conn_or_acquire() as client:
        ceiling = server_time(client) - float(qos.visibility_timeout)
        page = {"offset": start, "num": num} if num else {}
        try:
            with Mutex(client, qos.unacked_mutex_key, qos.unacked_mutex_expire):
                due = client.zrange(
                    qos.unacked_index_key, ceiling, 0, desc=True, byscore=True, **page
                )
                for tag in due or []:
                    qos.restore_by_tag(tag, client)
        except MutexHeld:
            pass


def _held_elsewhere(qos: Any, delivery_tag: str) -> bool:
    """True when another worker holds ``delivery_tag`` now (this copy is stale)."""
    holder = broker_client(qos.channel).hget(holders_key_of(qos.channel), delivery_tag)
    return holder is not None and text(holder) != qos.explicit_holder


def _ack_if_held(qos: Any, delivery_tag: str) -> None:
    """``QoS.ack`` of a consumer with ``lease_on_delivery``: removes the broker's
    record of the delivery only while this worker holds it.

    kombu removes by tag (``ZREM unacked_index``, ``HDEL unacked``), and a message a
    sweep restored keeps its tag. A stale copy (its process stopped past its lease,
    the job taken over elsewhere) that is acked when it wakes up would remove the
    record of the copy another worker is running: if that worker then died, nothing
    would restore the job. One script, one round trip, as kombu's own pipeline.
    """
    from kombu.transport import redis as kombu_redis

    if _withheld_for_another_copy(qos, delivery_tag, "ack"):
        return
    channel = qos.channel
    unacked = str(getattr(channel, "global_keyprefix", "") or "") + str(qos.unacked_key)
    keys = [unacked_index_key(channel), unacked, holders_key_of(channel)]
    removed = call(broker_client(channel), ACK, keys, [delivery_tag, qos.explicit_holder])
    if not removed:
        metrics.stale_acks_withheld.labels("ack").inc()
        logger.warning(
            "ack of delivery %s left to the worker that holds it now (this copy is stale)",
            delivery_tag,
        )
    super(kombu_redis.QoS, qos).ack(delivery_tag)


def _withheld_for_another_copy(qos: Any, delivery_tag: str, what: str) -> bool:
    """True when this worker holds another copy of ``delivery_tag``: the copy a sweep
    restored and this worker received again while it still held this one. kombu acks
    by tag, so this ack would remove the record (and kombu's in-memory entry) of the
    other copy; withheld, the record stays until the other copy's ack. Which copy acks
    first does not matter: the record goes with the last ack, and a worker that dies
    between the two leaves it to the sweep (the job is run again, never lost)."""
    copies = qos.explicit_copies
    if not copies.get(delivery_tag):
        return False
    copies[delivery_tag] -= 1
    if not copies[delivery_tag]:
        del copies[delivery_tag]
    metrics.stale_acks_withheld.labels(what).inc()
    logger.warning(
        "%s of delivery %s withheld: this worker holds another copy of it (a sweep "
        "restored the message while this one ran); that copy's ack removes the record",
        what,
        delivery_tag,
    )
    return True


def _reject_if_held(qos: Any, delivery_tag: str, requeue: bool = False) -> None:
    """``QoS.reject``: a requeue puts the message back only while this worker holds
    it (a stale copy's requeue would add a second copy and drop the live one's
    record); a reject without requeue removes the record as ``_ack_if_held`` does."""
    from kombu.transport import redis as kombu_redis

    if not requeue:
        _ack_if_held(qos, delivery_tag)
        return
    if _withheld_for_another_copy(qos, delivery_tag, "requeue"):
        return
    if _held_elsewhere(qos, delivery_tag):
        metrics.stale_acks_withheld.labels("requeue").inc()
        logger.warning("requeue of delivery %s left to the worker that holds it now", delivery_tag)
    else:
        qos.restore_by_tag(delivery_tag, leftmost=True)
    super(kombu_redis.QoS, qos).ack(delivery_tag)


def _restore_unacked_if_held(qos: Any, client: Any = None) -> None:
    """``QoS.restore_unacked`` (the channel's close): each message this worker still
    holds goes back to its queue; one another worker took over is left to it."""
    with qos.channel.conn_or_acquire(client) as conn:
        for tag in list(qos._delivered):
            if _held_elsewhere(qos, tag):
                metrics.stale_acks_withheld.labels("restore").inc()
                continue
            qos.restore_by_tag(tag, client=conn)
    qos._delivered.clear()
