"""The relay's connection to the broker: one producer, opened on first use, dropped after
a failure so the next batch starts on a fresh connection.

**Batches are pipelined** (kombu's ``Producer.batch``: one Redis round trip for the
whole batch); on a transport without batching, messages go one by one.
"""

from __future__ import annotations

import contextlib
from typing import Any

from celery import Celery
from kombu import exceptions as kombu_exceptions
from kombu.exceptions import OperationalError

from celery_explicit import job_log

__all__ = ["BrokerConnection", "batch"]

logger = job_log.get_logger("django_outbox.outbox.relay.loop")

# kombu >= 5.7: a pipelined batch whose flush failed (delivery uncertain).
_BatchPublishError: type[Exception] = getattr(
    kombu_exceptions, "BatchPublishError", OperationalError
)


class BrokerConnection:
    """The relay's write connection and its producer."""

    def __init__(self, app: Celery) -> None:
        self._app = app
        self._connection: Any = None
        self._producer: Any = None

    def producer(self) -> Any:
        if self._producer is None:
            self._connection = self._app.connection_for_write()
            self._producer = self._app.amqp.Producer(self._connection, auto_declare=False)
        return self._producer

    def close(self) -> None:
        """Drop the connection after a failure: the next batch starts a fresh one."""
        connection, self._connection, self._producer = self._connection, None, None
        if connection is not None:
            try:
                connection.collect()
            except Exception:  # a dead connection may fail to close; it is dropped anyway
                logger.debug("closing the broker connection failed", exc_info=True)

    def errors(self) -> tuple[type[BaseException], ...]:
        """What a broker (or dedup Redis) outage raises: wait it out, blame no event."""
        import redis

        transport_errors: tuple[type[BaseException], ...] = ()
        if self._connection is not None:
            transport_errors = tuple(self._connection.connection_errors)
        return (
            OperationalError,
            _BatchPublishError,
            ConnectionError,
            TimeoutError,
            redis.ConnectionError,
            redis.TimeoutError,
            # The Redis holding dedup ids and ordering numbers failing over or full:
            # an outage to wait out, not a fault of the event at hand.
            redis.exceptions.ReadOnlyError,
            redis.exceptions.OutOfMemoryError,
            redis.exceptions.TryAgainError,
            redis.exceptions.BusyLoadingError,
            *transport_errors,
        )


def batch(producer: Any, *, max_size: int) -> contextlib.AbstractContextManager[Any]:
    """kombu >= 5.7 batches publishes into one pipeline; older kombu sends each at once."""
    if hasattr(producer, "batch"):
        return producer.batch(max_size=max_size)  # type: ignore[no-any-return]
    return contextlib.nullcontext()
