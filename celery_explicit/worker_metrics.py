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
  ``EXPLICIT_WORKER_METRICS_PORT`` serves the merged files, dead children's included
  (counters must not go back when ``max_tasks_per_child`` replaces a child).
- ``worker_process_shutdown`` (a pool child leaving): ``mark_process_dead``, as
  prometheus_client documents, so live-mode gauges drop the child.

Nothing here adds a label: the metrics show what their modules put in them, and no
metric of ours carries an argument, a payload or an idempotency key.
"""

from __future__ import annotations

import glob
import logging
import os
import tempfile
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server, values
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from celery_explicit.conf import settings

__all__ = ["metrics_dir", "on_worker_init", "on_worker_ready", "switch_to_files"]

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
    port = settings.worker_metrics_port
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=_directory)  # type: ignore[no-untyped-call]
    try:
        start_http_server(port, registry=registry)
    except OSError as exc:
        logger.warning("worker metrics off: port %s cannot be served (%s)", port, exc)
        return
    logger.info("worker metrics on port %s, from %s", port, _directory)


def on_worker_process_shutdown(pid: int | None = None, **_: Any) -> None:
    """``worker_process_shutdown`` (in the child leaving): its counts stay in its file,
    merged into every later scrape; live-mode gauges forget it."""
    if _directory is not None and pid is not None:
        mark_process_dead(pid, _directory)  # type: ignore[no-untyped-call]


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
