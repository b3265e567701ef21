"""A TCP proxy in front of a server, whose connections a test can cut for a while."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable


class CuttableProxy:
    """Forwards every connection to ``upstream``; ``cut(seconds)`` closes them all and
    refuses new ones (accepted, then closed at once) for that long: what a process sees
    when its network to the server goes away and comes back. ``dropping = True`` keeps the
    connections open but throws away what the server sends: what a replica sees of a
    primary whose replication stream is lost on the way (the replica's link stays up, no
    write arrives)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._cut_until = 0.0
        self.refused = 0
        self.dropping = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def cut(self, seconds: float) -> int:
        """Close every open connection now and refuse new ones for ``seconds``; the
        number closed."""
        with self._lock:
            self._cut_until = time.monotonic() + seconds
            closing, self._open = self._open, []
        for sock in closing:
            _close(sock)
        return len(closing) // 2

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refused = time.monotonic() < self._cut_until
            if refused:
                self.refused += 1
                _close(client)
                continue
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._open += [client, server]
            threading.Thread(target=_pump, args=(client, server), daemon=True).start()
            threading.Thread(
                target=_pump, args=(server, client, lambda: not self.dropping), daemon=True
            ).start()

    def close(self) -> None:
        self.cut(0)
        _close(self._listener)


def _pump(
    source: socket.socket, sink: socket.socket, forward: Callable[[], bool] = lambda: True
) -> None:
    try:
        while data := source.recv(65536):
            if forward():
                sink.sendall(data)
    except OSError:
        pass
    _close(source)
    _close(sink)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
