"""A worker's metrics endpoint: every pool process counted, under prefork.

Under the prefork pool each child counts in its own memory; a scrape of one process
would see 1/N of the jobs. prometheus_client's multiprocess mode has every process
write its values to a file of its own in one directory and merges the files at scrape
time (https://prometheus.github.io/client_python/multiprocess/). Its docs (and
django-prometheus, and the OpenTelemetry multiprocess extension) expect
``PROMETHEUS_MULTIPROC_DIR`` set before Python starts; here one setting turns it on:

- ``worker_init`` (the main process, before the pool forks): the directory
  (``EXPLICIT_METRICS_DIR``) is created and emptied of a previous run's files, the
  environment variable set, and every metric already created switched to files
  (``switch_to_files``, below). A directory that cannot be written leaves the worker
  running without the endpoint, and says why in one log line.
- ``worker_ready`` (the main process, the pool forked): an HTTP server thread on
  ``EXPLICIT_WORKER_METRICS_PORT`` serves the merged files (``serve``, below).
- a pool child that exited, as the pool's parent sees it (``on_child_exit``, called
  from ``celery_explicit.bootsteps``): ``archive_dead`` folds its files into one
  archive file per kind, so counters never go back and the directory never grows
  with the children ``max_tasks_per_child`` replaces.

``serve`` listens on ``EXPLICIT_WORKER_METRICS_BIND`` (127.0.0.1 unless opened) and,
when ``EXPLICIT_METRICS_TOKEN`` is set, answers only a request that carries
``Authorization: Bearer <token>``, compared as the Django view compares it
(``bearer_refusal``); the relay's port is served the same way.

Nothing here adds a label: the metrics show what their modules put in them
(``celery_explicit.metrics`` bounds the ``task`` and ``lock`` labels).
"""

from __future__ import annotations

import glob
import hmac
import ipaddress
import logging
import os
import socket
import tempfile
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app, values
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from celery_explicit.conf import settings

__all__ = [
    "archive_dead",
    "bearer_refusal",
    "metrics_dir",
    "on_child_exit",
    "on_worker_init",
    "on_worker_ready",
    "serve",
    "switch_to_files",
]

logger = logging.getLogger("celery_explicit.worker_metrics")
#: The variable prometheus_client reads when a value is created and when a child is
#: marked dead.
ENV = "PROMETHEUS_MULTIPROC_DIR"
#: The metric types whose values prometheus_client can keep in files (Info and Enum
#: cannot: its docs).
FILE_BACKED = frozenset({"counter", "gauge", "histogram", "summary"})

#: The directory this process's metrics are written to; None: the endpoint is off.
_directory: str | None = None


def metrics_dir(port: int) -> str:
    """``EXPLICIT_METRICS_DIR``, or a directory of this port's own: two workers on
    one host have two ports, so they never empty each other's files."""
    return settings.metrics_dir or os.path.join(
        tempfile.gettempdir(), f"celery-explicit-metrics-{port}"
    )


def on_worker_init(sender: Any = None, **_: Any) -> None:
    """``worker_init``: prepare the directory and switch to files, before the fork."""
    global _directory
    port = settings.worker_metrics_port
    if not port:
        return
    directory = metrics_dir(port)
    try:
        _prepare(directory)
    except OSError as exc:
        logger.warning(
            "worker metrics off: the directory %s cannot be written (%s); set "
            "EXPLICIT_METRICS_DIR to a writable directory of this worker's own",
            directory,
            exc,
        )
        return
    switch_to_files(directory)
    _directory = directory


def on_worker_ready(sender: Any = None, **_: Any) -> None:
    """``worker_ready``: serve the merged files. Started after the pool forked, so no
    child inherits the listening socket."""
    if _directory is None:
        return
    port, bind = settings.worker_metrics_port, settings.worker_metrics_bind
    registry = CollectorRegistry()
    _ArchiveAwareCollector(registry, path=_directory)  # type: ignore[no-untyped-call]
    try:
        serve(registry, port=port, bind=bind)
    except OSError as exc:
        logger.warning("worker metrics off: %s:%s cannot be served (%s)", bind, port, exc)
        return
    logger.info("worker metrics on %s:%s, from %s", bind, port, _directory)


def on_child_exit(pid: int) -> None:
    """The pool's parent, once it has joined the child ``pid``: fold the child's files
    into the archive. In the parent because a child that was killed runs no hook of
    its own, and before the pool forks a replacement, so no new child of ours can
    reuse the pid while its files are read."""
    if _directory is None:
        return
    with _files_mutex:
        archive_dead(_directory, pid)


# --- the files of dead children -------------------------------------------------------
# prometheus_client's ``mark_process_dead`` only deletes a dead process's live-mode gauge
# files; its counter and histogram files stay, read by every scrape, one set per
# child ``max_tasks_per_child`` replaced. Their values add up (a histogram file holds
# per-bucket counts, not cumulative ones), so a dead child's file is added into one
# ``<kind>_archive.db`` and deleted: the directory holds the live processes' files and
# one archive per kind, whatever the number of children that came and went.

#: Scrapes and archiving take turns: a scrape between the archive's write and the
#: dead file's removal would count the child twice, and the counters would go back.
_files_mutex = threading.Lock()
#: The pid part of an archive file's name (a gauge's pid label, dropped by its mode).
ARCHIVE = "archive"

Entry = tuple[float, float]
"""A value and its timestamp, as a multiprocess file holds them."""


def _add(old: Entry, new: Entry) -> Entry:
    return old[0] + new[0], max(old[1], new[1])


def _latest(old: Entry, new: Entry) -> Entry:
    return new if new[1] >= old[1] else old


def _least(old: Entry, new: Entry) -> Entry:
    return new if new[0] < old[0] else old


def _most(old: Entry, new: Entry) -> Entry:
    return new if new[0] > old[0] else old


#: How a dead process's entry joins the archive's, by file kind (a gauge by its
#: multiprocess mode). Not here, so deleted: live-mode gauges (a dead process is not
#: live: ``mark_process_dead`` deletes them) and mode "all" (a series per pid, so one
#: more series per dead child, kept forever).
_COMBINE: dict[str, Callable[[Entry, Entry], Entry]] = {
    "counter": _add,
    "histogram": _add,
    "summary": _add,
    "gauge_sum": _add,
    "gauge_min": _least,
    "gauge_max": _most,
    "gauge_mostrecent": _latest,
}


def archive_dead(directory: str, pid: int) -> None:
    """Fold the files of the dead process ``pid`` into ``directory``'s archive files
    and delete them. The caller holds off scrapes of ``directory`` meanwhile."""
    mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]
    for path in glob.glob(os.path.join(directory, f"*_{pid}.db")):
        kind = os.path.basename(path)[: -len(f"_{pid}.db")]
        combine = _COMBINE.get(kind)
        if combine is not None:
            _fold(path, os.path.join(directory, f"{kind}_{ARCHIVE}.db"), combine)
        os.remove(path)


def _fold(path: str, archive: str, combine: Callable[[Entry, Entry], Entry]) -> None:
    merged = dict(_read(archive)) if os.path.exists(archive) else {}
    for key, entry in _read(path):
        merged[key] = combine(merged[key], entry) if key in merged else entry
    # Written aside, then renamed: a worker killed mid-write leaves the old archive
    # whole, and the scrape reads only "*.db".
    partial = archive + ".partial"
    if os.path.exists(partial):
        os.remove(partial)
    written = MmapedDict(partial)  # type: ignore[no-untyped-call]
    try:
        for key, (value, timestamp) in merged.items():
            written.write_value(key, value, timestamp)  # type: ignore[no-untyped-call]
    finally:
        written.close()  # type: ignore[no-untyped-call]
    os.replace(partial, archive)


def _read(path: str) -> list[tuple[str, Entry]]:
    found = MmapedDict.read_all_values_from_file(path)  # type: ignore[no-untyped-call]
    return [(key, (value, timestamp)) for key, value, timestamp, _ in found]


class _ArchiveAwareCollector(MultiProcessCollector):
    """prometheus_client's collector, taking turns with ``archive_dead``."""

    def collect(self) -> Iterable[Metric]:
        with _files_mutex:
            return list(super().collect())  # type: ignore[no-untyped-call]


# --- the HTTP endpoint ----------------------------------------------------------------


def bearer_refusal(authorization: str, token: str) -> tuple[int, str] | None:
    """Why a request with this ``Authorization`` header is refused (status, text), or
    None when ``token`` is unset or the header carries it. Compared in constant time:
    the answer must not tell a caller how much of a guess was right."""
    if not token:
        return None
    if not authorization:
        return 401, "a bearer token is required\n"
    if not hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode()):
        return 403, "wrong token\n"
    return None


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """A scrape every few seconds is not worth a log line."""


def serve(registry: Collector | CollectorRegistry, *, port: int, bind: str) -> WSGIServer:
    """Serve ``registry`` on ``bind``:``port`` from a daemon thread, behind
    ``EXPLICIT_METRICS_TOKEN`` when it is set. Raises OSError when it cannot listen."""
    exposition = make_wsgi_app(registry)

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        refused = bearer_refusal(environ.get("HTTP_AUTHORIZATION", ""), settings.metrics_token)
        if refused is None:
            return exposition(environ, start_response)  # type: ignore[no-any-return]
        status, text = refused
        headers = [("Content-Type", "text/plain; charset=utf-8")]
        if status == 401:
            headers.append(("WWW-Authenticate", "Bearer"))
        start_response(f"{status} {'Unauthorized' if status == 401 else 'Forbidden'}", headers)
        return [text.encode()]

    server_class = _Server6 if _is_ipv6(bind) else _Server
    httpd = make_server(bind, port, guarded, server_class, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name=f"metrics:{port}", daemon=True).start()
    if not settings.metrics_token and not _is_loopback(bind):
        logger.warning(
            "metrics on %s:%s are open to the network without a token: set EXPLICIT_METRICS_TOKEN",
            bind,
            port,
        )
    return httpd


def _is_ipv6(bind: str) -> bool:
    try:
        return ipaddress.ip_address(bind).version == 6
    except ValueError:
        return False


def _is_loopback(bind: str) -> bool:
    try:
        return ipaddress.ip_address(bind).is_loopback
    except ValueError:
        return bind == "localhost"


def switch_to_files(directory: str) -> None:
    """Make every value created from now on, and every one created so far, a file's.

    prometheus_client picks a value's class when the value is created: an unlabeled
    metric at import, a labeled one on each first ``labels(...)``. Our metric modules
    (and the project's) are imported before ``worker_init``, and some hold children
    bound at import (a ``Lock`` or a cache declared at module level), so switching
    ``values.ValueClass`` alone would leave those counting in memory. Each one's
    values are created again instead (``_metric_init``: what prometheus_client runs
    when it creates a metric); anything counted before the worker started is dropped.
    The prefork test (tests/integration/test_metrics_worker.py) fails if
    prometheus_client stops working this way.
    """
    os.environ[ENV] = directory
    values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
    # The registry's own list of what it collects: a private attribute, read only.
    for collector in list(getattr(REGISTRY, "_collector_to_names", {})):
        if isinstance(collector, MetricWrapperBase) and collector._type in FILE_BACKED:
            _recreate_values(collector)


def _recreate_values(metric: Any) -> None:
    # Any: prometheus_client leaves these methods untyped.
    if metric._is_observable():
        metric._metric_init()
        return
    with metric._lock:
        children = list(metric._metrics.values())
    for child in children:
        child._metric_init()


def _prepare(directory: str) -> None:
    """Create the directory, empty it of a previous run's files, prove it writable."""
    os.makedirs(directory, exist_ok=True)
    # Only prometheus_client's files: the directory may be one the operator chose.
    for path in glob.glob(os.path.join(directory, "*.db")):
        os.remove(path)
    with tempfile.TemporaryFile(dir=directory):
        pass
