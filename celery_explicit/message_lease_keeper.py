"""The message lease's heartbeat: ``LeaseKeeper``, a consumer bootstep of the worker.

``celery_explicit.message_lease`` says what the lease is; this step keeps it. At each
heartbeat (``HEARTBEAT_FRACTION`` of the shortest task lease, between 0.2 s and 10 s)
the worker's main process moves the deadline of each message it holds, running or
scheduled, and extends the execution lease (``celery_explicit.execution_lease``) and
the entity's turn (``celery_explicit.ordering``) of each handler a pool process runs;
a stopped pool child's leases are left to run out. One pipeline per Redis: one round
trip, however many jobs the worker holds.

Between heartbeats, every ``FIRST_LEASE_INTERVAL``, a look gives each message received
since the last its lease record (and its lease, if the delivery did not write one).
When the consumer stops, ``celery_explicit.message_lease_drain`` takes the heartbeat
over until the pool has drained. Added to the consumer by ``celery_explicit.bootsteps``.
"""

from __future__ import annotations

import socket
from typing import Any

from celery import bootsteps

from celery_explicit import execution_lease, job_log, metrics, ordering, redis_state
from celery_explicit.conf import settings
from celery_explicit.message_lease import (
    EXTEND,
    broker_client,
    child_is_stopped,
    contract_of,
    extend_arguments,
    held_requests,
    holder_id,
    holders_key_of,
    unacked_index_key,
)
from celery_explicit.message_lease_drain import Drain
from celery_explicit.message_lease_transport import lease_on_delivery
from celery_explicit.redis_scripts import call_many

logger = job_log.get_logger("celery_explicit.message_lease_keeper")

#: Extend every lease at this fraction of its timeout.
HEARTBEAT_FRACTION = 0.25
#: Seconds between looks for messages received since the last heartbeat: each gets its
#: lease record then (its lease it got on delivery, ``lease_on_delivery``). Cheap: a
#: look with nothing new sends nothing.
FIRST_LEASE_INTERVAL = 0.1


class LeaseKeeper(bootsteps.StartStopStep):
    """Consumer step: moves each held ExplicitTask message's deadline forward."""

    label = "celery_explicit: per-task visibility leases"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._tref: Any = None
        self._first_tref: Any = None
        self._redis_broker = False
        self._host = socket.gethostname()
        #: Delivery tags whose message has its lease, and those found already gone
        #: (acked between the listing and the lease): neither is leased anew by the
        #: first-lease look. Both are pruned to the messages still held at each
        #: heartbeat.
        self._leased: set[str] = set()
        self._gone: set[str] = set()
        self._interval: float | None = None
        #: Keeps the heartbeat while the pool drains, from this step's stop to its start.
        self._drain = Drain(self._extend_execution_leases, self._host)

    def start(self, parent: Any) -> None:
        self._drain.stop()  # the consumer is back: its timer keeps the leases again
        leases = [
            contract.visibility_timeout
            for contract in map(contract_of, parent.app.tasks.values())
            if contract is not None
        ]
        if not leases:
            return
        interval = self._interval = max(0.2, min(10.0, min(leases) * HEARTBEAT_FRACTION))
        if getattr(parent.connection.transport, "driver_type", "") == "redis":
            self._redis_broker = True
            self._drain.remember(parent.connection.default_channel)
            lease_on_delivery(
                parent.task_consumer.channel.qos,
                {
                    name: contract.visibility_timeout
                    for name, task in parent.app.tasks.items()
                    if (contract := contract_of(task)) is not None
                },
            )
            self._first_tref = parent.timer.call_repeatedly(
                FIRST_LEASE_INTERVAL, self.first_leases, (parent,)
            )
        self._tref = parent.timer.call_repeatedly(interval, self.tick, (parent,))

    def stop(self, parent: Any) -> None:
        for tref in (self._tref, self._first_tref):
            if tref is not None:
                tref.cancel()
        self._tref = self._first_tref = None
        self._drain.start(self._interval)

    def tick(self, parent: Any) -> None:
        """The heartbeat: every held message's lease, and every execution lease."""
        held = held_requests()
        self._extend_execution_leases(held)
        if not self._redis_broker:
            return  # the broker has no visibility timeout
        tags = {request.message.delivery_tag for request in held}
        self._leased &= tags
        self._gone &= tags
        self._lease_messages(parent, held)

    def first_leases(self, parent: Any) -> None:
        """Between heartbeats: a first lease for each message received since the last."""
        new = [
            request
            for request in held_requests()
            if contract_of(request.task) is not None
            and request.message.delivery_tag not in self._leased
            and request.message.delivery_tag not in self._gone
        ]
        if new:
            self._lease_messages(parent, new)

    def _lease_messages(self, parent: Any, held: list[Any]) -> None:
        import redis

        channel = parent.connection.default_channel
        try:
            self._extend_all(channel, broker_client(channel), held)
        except channel.connection_errors:
            logger.warning("could not extend leases: broker connection lost")
        except redis.RedisError as exc:
            # Out of memory, read-only after a failover: the leases run out unless a
            # later look or heartbeat succeeds. Never an error out of the consumer's timer.
            logger.warning("could not extend leases: %s", exc)

    def _extend_execution_leases(self, held: list[Any]) -> None:
        """Extend the execution lease of each live, running handler, and its entity's
        turn where it holds one (any broker): one pipeline for all of them."""
        import redis

        if not settings.lease_extend:
            return
        leases, turns = [], []
        for request in held:
            pid = request.worker_pid
            contract = contract_of(request.task)
            if contract is None or not pid:
                continue  # not started in a pool child yet: it holds no lease
            if child_is_stopped(pid):
                continue  # counted by the visibility lease below (Redis) or not at all
            owner = f"{self._host}:{pid}"
            leases.append((request.id, owner, contract.visibility_timeout))
            place = ordering.place_in(request.request_dict) if contract.ordering else None
            if place is not None:
                turns.append((place[0], request.id, contract.visibility_timeout))
        calls = ordering.alive_extensions(turns)
        if execution_lease.enabled():
            calls += execution_lease.extensions(leases)
        if not calls:
            return
        try:
            call_many(redis_state.client(), calls)
        except redis.RedisError:
            logger.warning("could not extend execution leases: Redis unavailable")

    def _extend_all(self, channel: Any, client: Any, held: list[Any]) -> None:
        """Move the lease of each message in ``held``: one round trip for all of them."""
        backstop = float(channel.visibility_timeout)
        extend = settings.lease_extend
        index, holders, me = unacked_index_key(channel), holders_key_of(channel), holder_id()
        calls: list[tuple[Any, str, list[Any], list[Any]]] = []
        for request in held:
            task = request.task
            contract = contract_of(task)
            if contract is None:
                continue
            # Keyed by delivery: a deferral or a retry is a new message with the same
            # task id, and must get its own lease.
            tag = request.message.delivery_tag
            if not extend and tag in self._leased:
                continue  # switched off: each message gets its lease once, never more
            pid = request.worker_pid
            if child_is_stopped(pid):
                metrics.lease_not_extended.labels(task.name, "child_stopped").inc()
                if tag in self._leased:
                    continue
                # Stopped before its first heartbeat: its message still has kombu's
                # score (its delivery time), so it would wait out the global timeout.
                # Give it its own lease once; it runs out T from now.
            keys, args = extend_arguments(
                request, contract, index, holders, backstop, self._host, me
            )
            calls.append((task, tag, keys, args))
        if not calls:
            return
        replies = call_many(client, [(EXTEND, keys, args) for _t, _tag, keys, args in calls])
        for (task, tag, _keys, _args), moved in zip(calls, replies, strict=True):
            if moved:
                self._leased.add(tag)
                metrics.lease_extensions.labels(task.name).inc()
            else:
                self._gone.add(tag)
