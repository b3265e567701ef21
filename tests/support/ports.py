"""TCP ports for servers of a test's own, or for a broker that is down."""

from __future__ import annotations

import contextlib
import socket


def free_port() -> int:
    """A local TCP port nothing listens on at the time of the call."""
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
