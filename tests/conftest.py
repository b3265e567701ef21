"""Fixtures: real services only. A missing service fails the run; it is never skipped."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import django
import pytest
import redis

from tests.support.workers import Worker

# django.tasks exists from Django 6.0, and its backend's declarations from 6.1: those
# tests run in the matrix's Django 6 sessions (noxfile.py). On an older Django they are
# not collected at all, rather than skipped (a skip fails the suite, below).
collect_ignore_glob = [] if django.VERSION >= (6, 1) else ["*/test_django_tasks*.py"]


@pytest.fixture(scope="session")
def redis_client() -> redis.Redis:
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    client.ping()  # fails loudly when Redis is down: the test command starts it
    return client


RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


@pytest.fixture
def queue(redis_client: redis.Redis) -> str:
    return f"q-{uuid.uuid4().hex[:10]}"


@pytest.fixture(params=["redis", "rabbitmq"])
def broker(request: pytest.FixtureRequest, queue: str) -> Iterator[str]:
    """Run the test on each broker; yields the broker URL workers and publishers use."""
    from django.conf import settings
    from kombu import Connection

    url = settings.REDIS_URL if request.param == "redis" else RABBITMQ_URL
    if request.param == "rabbitmq":
        with Connection(url) as conn:
            conn.ensure_connection(max_retries=3)  # fails loudly if RabbitMQ is down
    yield url
    if request.param == "rabbitmq":
        # The test's queue was declared by its worker; it must not outlive the test
        # (it was never declared if the test failed early: nothing to delete then).
        with Connection(url) as conn, contextlib.suppress(Exception):
            conn.channel().queue_delete(queue)


@pytest.fixture
def start_relay(transactional_db: None, queue: str, tmp_path: Path) -> Iterator[Any]:
    """Start ``manage.py explicit_relay`` processes on this test's queue
    (tests/support/relays.py); all are stopped before the tables are flushed."""
    from tests.support.relays import relay_starter

    yield from relay_starter(queue, tmp_path)


@pytest.fixture
def start_worker(
    transactional_db: None, queue: str, tmp_path: Path, redis_client: redis.Redis
) -> Iterator[Callable[..., Worker]]:
    """Start real worker processes on this test's queue; all are stopped afterwards.

    Depends on ``transactional_db`` so the workers (separate processes) see committed
    rows, and are stopped before pytest-django flushes the tables.
    """
    from django.db import connection

    started: list[Worker] = []

    def start(**kwargs: Any) -> Worker:
        kwargs.setdefault("queue", queue)
        worker = Worker(db_name=connection.settings_dict["NAME"], log_dir=tmp_path, **kwargs)
        started.append(worker)
        return worker.wait_ready()

    yield start
    # Side by side: each warm shutdown waits for its pool, none for another's.
    for worker in started:
        worker.begin_stop()
    for worker in started:
        worker.stop()
    redis_client.delete(queue)


# --- the suite never skips --------------------------------------------------------------
# A skipped test is a test that did not run: on a machine without a service it must fail,
# so CI can never go green with part of the suite silently missing.
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
    if skipped and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if reporter:
            reporter.write_line(
                f"FAILED: {skipped} test(s) skipped; the suite must not skip", red=True
            )
