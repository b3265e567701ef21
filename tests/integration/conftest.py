"""Fixtures shared by the integration tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support.servers import PrivateRedis


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A redis-server nobody else talks to (one per test module); its socket's path. For
    what must not touch the shared server: FUNCTION DELETE, FLUSHALL."""
    server = PrivateRedis(tmp_path_factory.mktemp("redis"), unix_socket=True, durable=False)
    server.start()
    try:
        assert server.socket_path is not None
        yield server.socket_path
    finally:
        server.stop()


@pytest.fixture
def prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    p = f"explicit-test:{uuid.uuid4().hex[:8]}:"
    yield p
    keys = list(redis_client.scan_iter(match=f"{p}*"))
    if keys:
        redis_client.delete(*keys)


@pytest.fixture
def rabbitmq_queue_with_old_head(queue: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The app pointed at RabbitMQ, this test's queue as its default, and in it two
    messages: the head one with an AMQP timestamp of five minutes ago, then a fresh one.
    The queue is deleted afterwards."""
    import contextlib
    import time

    from kombu import Connection

    from tests.celery_app import app
    from tests.conftest import RABBITMQ_URL
    from tests.testapp.tasks import Increment

    monkeypatch.setitem(app.conf, "task_default_queue", queue)
    monkeypatch.setitem(app.conf, "broker_url", RABBITMQ_URL)
    monkeypatch.setitem(app.conf, "broker_read_url", RABBITMQ_URL)
    task = app.tasks[Increment.name]
    try:
        with Connection(RABBITMQ_URL) as conn:
            task.apply_async(
                kwargs={"name": "q", "op_id": "1"},
                queue=queue,
                connection=conn,
                timestamp=int(time.time()) - 300,
            )
            task.apply_async(kwargs={"name": "q", "op_id": "2"}, queue=queue, connection=conn)
        yield queue
    finally:
        with Connection(RABBITMQ_URL) as conn, contextlib.suppress(Exception):
            conn.channel().queue_delete(queue)
