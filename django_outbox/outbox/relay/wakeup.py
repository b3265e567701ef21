"""How an idle relay learns that there is something to publish again.

On PostgreSQL the writer NOTIFYs in its transaction, delivered at commit; the relay
LISTENs on a dedicated connection and claims at once. Without it (SQLite, or
``EXPLICIT_OUTBOX_NOTIFY_CHANNEL = ""``) it polls every ``EXPLICIT_OUTBOX_POLL_INTERVAL``
seconds. Either way a write on the relay's stop pipe (``Relay.stop()``) ends the wait.
"""

from __future__ import annotations

import select
from typing import Any

from celery_explicit import job_log
from django_outbox.db import outbox_sql

__all__ = ["Wakeup", "ListenWakeup", "wakeup_for"]

# The relay's logger: an operator filtering on "django_outbox.outbox.relay.loop" sees the relay's
# LISTEN troubles with the rest of its log.
logger = job_log.get_logger("django_outbox.outbox.relay.loop")


class Wakeup:
    """Waits for a reason to look at the outbox again: the poll interval, or ``stop()``."""

    kind = "polling"

    def __init__(self, stop_fd: int) -> None:
        self._stop_fd = stop_fd

    def wait(self, timeout: float) -> None:
        select.select([self._stop_fd], [], [], timeout)

    def close(self) -> None:
        pass


class ListenWakeup(Wakeup):
    """PostgreSQL: also a NOTIFY on the channel, on a dedicated autocommit connection.

    Django's own connection is in and out of transactions; a LISTEN there would be
    lost whenever Django closes it. A lost listening connection is reconnected on the
    next wait, which then returns at once: a NOTIFY sent meanwhile is gone.
    """

    kind = "LISTEN/NOTIFY"

    def __init__(self, connection: Any, channel: str, stop_fd: int) -> None:
        super().__init__(stop_fd)
        self._params = connection.get_connection_params()
        self._channel = channel
        self._listener: Any = None
        self._connect()

    def _connect(self) -> bool:
        import psycopg
        from psycopg import sql

        try:
            listener = psycopg.connect(**self._params, autocommit=True)
            listener.execute(sql.SQL(outbox_sql.LISTEN).format(sql.Identifier(self._channel)))
        except psycopg.Error as exc:
            logger.warning(
                "outbox relay: cannot LISTEN on %r (%s); polling until it can",
                self._channel,
                exc,
            )
            return False
        self._listener = listener
        return True

    def wait(self, timeout: float) -> None:
        import psycopg

        if self._listener is None:
            if self._connect():
                return  # notifications sent while we were not listening are lost
            super().wait(timeout)
            return
        ready, _, _ = select.select([self._stop_fd, self._listener.fileno()], [], [], timeout)
        if self._listener.fileno() in ready:
            try:
                for _notify in self._listener.notifies(timeout=0):
                    pass  # one wake-up is enough: the claim reads whatever committed
            except psycopg.Error:
                self.close()

    def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()


def wakeup_for(connection: Any, channel: str, stop_fd: int) -> Wakeup:
    """LISTEN/NOTIFY on PostgreSQL when a channel is set, else polling."""
    if connection.vendor == "postgresql" and channel:
        return ListenWakeup(connection, channel, stop_fd)
    return Wakeup(stop_fd)
