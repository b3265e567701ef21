"""The visibility timeout belongs to the task: a lease on its message, kept while alive.

Celery's Redis transport has one global visibility timeout (celery#9349): a message
unacknowledged for longer is handed to another worker, so an ``acks_late`` task longer
than it runs twice (celery#5935), while a dead worker's message waits the whole global
timeout (default 1 h) before anyone runs it.

kombu keeps each unacknowledged message in the sorted set ``unacked_index``, scored by
delivery time; its periodic sweep (``restore_visible``) puts back every entry scored
below ``now - visibility_timeout``. Scoring an entry ``now + T - visibility_timeout``
therefore makes that message visible again ``T`` seconds from now. The worker's main
process does that every ``T / 4`` for each message it holds, with ``T`` the task's own
``visibility_timeout``:

- while the handler is alive the deadline keeps moving: a long but healthy task is
  never redelivered, however long it runs;
- when the worker dies the deadline stops moving: the job is visible again after ``T``
  plus one sweep (``unacked_restore_interval``), not after the global timeout;
- a message has its lease from the moment it is delivered: the write that records it
  as unacknowledged already scores it ``now + T - visibility_timeout``
  (``message_lease_transport.lease_on_delivery``), so a worker killed at any moment
  after the delivery leaves its job to ``T``, never to the global timeout. (Scored
  with its delivery time until the keeper's first look, up to 0.1 s later, 2 of 8
  whole-worker kills in a kill storm left their job to the global timeout:
  tests/fault/test_lease_window.py.) The lease record an operator reads is written at
  that first look (``message_lease_keeper.FIRST_LEASE_INTERVAL``), which also leases
  any message the delivery did not (a task this worker does not know);
- a pool child that is stopped (SIGSTOP, ``T`` state in /proc) is not extended: its
  lease runs out like a dead worker's;
- during a warm shutdown (a deploy's SIGTERM) Celery stops the consumer, and this
  heartbeat with it, before the pool has drained: a thread of the main process then
  keeps extending what still runs and gives back at once what never started
  (``celery_explicit.message_lease_drain``);
- every time is the Redis server's (``TIME`` inside the scripts that write a score,
  and in the sweep that compares them,
  ``message_lease_transport.sweep_by_server_clock``): the host that leases a message
  and the one that sweeps may disagree on the time by more than a lease, the server
  cannot disagree with itself;
- a message a sweep restored keeps its delivery tag, and kombu acks by tag: beside
  ``unacked`` a hash names the worker that holds each delivery now, and the ack,
  requeue and shutdown restore of any other worker (a stale copy) leave its record
  alone; a worker holding two copies of one tag (it received the sweep's copy while
  it still held the first) withholds the first of their acks
  (``message_lease_transport``: kombu's ack, reject and restore replaced).

Each extension is one ``ZADD XX`` (the entry must still exist: an acked message is not
resurrected) plus the lease record an operator reads: ``{prefix}lease:{task_id}``, a
hash with owner (host:pid), deadline, extensions and the delivery tag, expiring with
the lease. All the messages of one heartbeat (or of one first-lease look) go in one
pipeline: one round trip, however many messages the worker holds. The global
``visibility_timeout`` stays as the backstop and must be longer than every task's
lease (``manage.py check``: django_outbox.E003).

The visibility part is for the Redis broker only; on RabbitMQ the broker redelivers on
connection loss, not on time. On every broker the same heartbeat extends each running
handler's execution lease (``celery_explicit.execution_lease``), which keeps a second
delivery of a job from running while the first is alive.

The lease is four modules, one per part of the worker it lives in:

- ``message_lease`` (this one): the lease's keys and record, the script that moves a
  deadline (``EXTEND``), the requests a worker holds, and ``live_leases`` for operators;
- ``message_lease_transport``: what replaces kombu's own methods on the Redis
  transport: the lease written with the delivery, the holder-checked ack, reject and
  restore, and the sweep by the server's clock;
- ``message_lease_keeper``: ``LeaseKeeper``, the consumer bootstep whose heartbeat
  extends every held message's lease and every running handler's execution lease;
- ``message_lease_drain``: the thread that keeps that heartbeat going through a warm
  shutdown, once the consumer has stopped.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

from celery_explicit import execution_lease, redis_state
from celery_explicit.contract import Contract
from celery_explicit.redis_scripts import SERVER_NOW_MS, Script, server_time
from celery_explicit.redis_state import text

# KEYS[1] - kombu's unacked_index sorted set
# KEYS[2] - the lease record (hash)
# KEYS[3] - the delivery holders (hash: delivery tag -> the worker holding it)
# ARGV[1] - delivery tag
# ARGV[2] - lease length in milliseconds (the record's TTL)
# ARGV[3] - the global visibility timeout in milliseconds (the backstop)
# ARGV[4] - owner (host:pid of the pool child, or of the worker before it starts)
# ARGV[5] - this worker's holder id (``holder_id()``)
# The deadline is the server's clock plus the lease, and the score that deadline less
# the backstop: the sweep that compares it (``message_lease_transport``) reads the same
# clock.
# return 1 if the message is still unacknowledged, held by this worker, and its lease
# was moved, otherwise 0 (the record is deleted only if it is this delivery's: a retry
# or a deferral of the same job is a newer delivery with the same task id, and keeps
# its own; a delivery another worker took over keeps its lease and its record)
EXTEND = Script(
    "message_lease_extend_held",
    SERVER_NOW_MS
    + """
if not redis.call('zscore', KEYS[1], ARGV[1]) then
    if redis.call('hget', KEYS[2], 'tag') == ARGV[1] then
        redis.call('del', KEYS[2])
    end
    return 0
end
local holder = redis.call('hget', KEYS[3], ARGV[1])
if holder and holder ~= ARGV[5] then
    return 0
end
local deadline_ms = now_ms + tonumber(ARGV[2])
redis.call('zadd', KEYS[1], 'XX', (deadline_ms - tonumber(ARGV[3])) / 1000, ARGV[1])
redis.call('hset', KEYS[2], 'owner', ARGV[4], 'deadline_ms', string.format('%.0f', deadline_ms),
    'tag', ARGV[1])
redis.call('hincrby', KEYS[2], 'extensions', 1)
redis.call('pexpire', KEYS[2], ARGV[2])
return 1
""",
)

_holder_id = ""


def holder_id() -> str:
    """This worker process's name in the delivery holders: host:pid and a random part
    (a pid is reused; a restarted worker must not pass for the one before it)."""
    global _holder_id
    me = f"{socket.gethostname()}:{os.getpid()}:"
    if not _holder_id.startswith(me):  # computed again in a forked process
        _holder_id = me + uuid.uuid4().hex[:8]
    return _holder_id


def holders_key(unacked_key: str) -> str:
    """The hash beside kombu's ``unacked`` naming which worker holds each delivery."""
    return f"{unacked_key}_holder"


def record_key(task_id: str, *, prefix: str | None = None) -> str:
    """The message lease's record (owner, deadline, extensions) an operator reads."""
    return f"{prefix or redis_state.prefix()}lease:{task_id}"


def unacked_index_key(channel: Any) -> str:
    """kombu's ``unacked_index`` of ``channel``, as the server names it.

    kombu's own client adds the transport's ``global_keyprefix`` to the first key of an
    ``EVALSHA`` and to no key of an ``FCALL`` (``GlobalKeyPrefixMixin.
    PREFIXED_COMPLEX_COMMANDS`` in kombu/transport/redis.py,
    https://github.com/celery/kombu/blob/v5.5.0/kombu/transport/redis.py). So the
    heartbeat talks through a plain client on the channel's connection pool and adds
    the prefix itself. ``tests/integration/test_lease_keeper.py`` (run with and without
    a global prefix) and ``test_upstream_seams.py`` fail if kombu moves the index,
    renames these attributes or changes how it scores the index.
    """
    return str(getattr(channel, "global_keyprefix", "") or "") + str(channel.unacked_index_key)


def holders_key_of(channel: Any) -> str:
    """Our delivery holders beside kombu's ``unacked`` of ``channel``, as the server
    names them (the transport's ``global_keyprefix`` added, as ``unacked_index_key``)."""
    return str(getattr(channel, "global_keyprefix", "") or "") + holders_key(
        str(channel.unacked_key)
    )


def broker_client(channel: Any) -> Any:
    """A plain redis-py client on the channel's own connection pool, kept while the
    pool lives: a pooled connection, never channel.client's own (that one may be
    blocked in BRPOP, and a reply read by the wrong reader stops the worker), and no
    kombu key prefixing (``unacked_index_key``: kombu would prefix only the first key
    of a script call)."""
    import redis

    pool = channel.pool
    client = getattr(channel, "explicit_client", None)
    if client is None or client.connection_pool is not pool:
        client = channel.explicit_client = redis.Redis(connection_pool=pool)
    return client


def child_is_stopped(pid: int | None) -> bool:
    """True when the pool child is stopped (SIGSTOP, a debugger): /proc state T or t."""
    if not pid:
        return False
    return execution_lease.process_state(pid) in (b"T", b"t")


def contract_of(task: Any) -> Contract | None:
    """The contract of an ExplicitTask (None for any other task): read from the task,
    not by importing the task class, which sits above this module."""
    contract = getattr(task, "contract", None)
    return contract if isinstance(contract, Contract) else None


def held_requests() -> list[Any]:
    """Every request whose message this worker holds unacknowledged.

    The reserved ones (running, or waiting for a pool slot) and the scheduled ones (an
    ETA or a countdown: a retry, a deferral), which wait in the worker's memory until
    their time and whose message must come back as soon if the worker dies.
    """
    from celery.worker import state

    held = list(state.reserved_requests)
    seen = {id(request) for request in held}
    # Celery 5.7 lists them in a WeakSet of their own (celery/worker/state.py,
    # ``scheduled_requests``: https://github.com/celery/celery/blob/main/celery/worker/
    # state.py); before 5.7 it has none and they go unleased until they start.
    # tests/integration/test_upstream_seams.py fails if it goes away.
    scheduled = list(getattr(state, "scheduled_requests", ()))
    held += [r for r in scheduled if id(r) not in seen]
    return held


def extend_arguments(
    request: Any,
    contract: Contract,
    index: str,
    holders: str,
    backstop: float,
    host: str,
    me: str,
) -> tuple[list[Any], list[Any]]:
    """``EXTEND``'s keys and arguments for ``request``'s message: its deadline the
    server's now plus the task's lease, scored against the broker's ``backstop``."""
    keys = [index, record_key(request.id), holders]
    args = [
        request.message.delivery_tag,
        int(contract.visibility_timeout * 1000),
        int(backstop * 1000),
        f"{host}:{request.worker_pid or os.getpid()}",
        me,
    ]
    return keys, args


@dataclass(frozen=True)
class LiveLease:
    """A held message's lease as an operator sees it (``manage.py explicit_leases``)."""

    task_id: str
    owner: str
    extensions: int
    expires_in: float  # seconds until the message is visible to other workers again
    delivery_tag: str


def live_leases(client: Any, *, prefix: str | None = None) -> list[LiveLease]:
    """Every lease record in the broker's Redis (SCAN, not KEYS)."""
    found = []
    prefix = prefix or redis_state.prefix()
    for raw_key in client.scan_iter(match=f"{prefix}lease:*", count=500, _type="HASH"):
        key = text(raw_key)
        info = {text(k): text(v) for k, v in client.hgetall(key).items()}
        # The clock is read after the record: a heartbeat landing between a clock read
        # first and the record would show more time left than the lease's length. The
        # server's clock: the deadline was written in it.
        now_ms = server_time(client) * 1000
        if not info:
            continue  # acked or expired between SCAN and now
        found.append(
            LiveLease(
                task_id=key[len(f"{prefix}lease:") :],
                owner=info.get("owner", ""),
                extensions=int(info.get("extensions", 0)),
                expires_in=max(0.0, (int(info.get("deadline_ms", now_ms)) - now_ms) / 1000.0),
                delivery_tag=info.get("tag", ""),
            )
        )
    return sorted(found, key=lambda lease: lease.expires_in)
