"""What ``manage.py explicit_leases`` lists, against real Redis: a message lease whose
message was already acknowledged (its job done; the record lingers until its worker's
next heartbeat or its expiry) is left out, or marked with ``--all``; columns stay
aligned with a 16-digit fencing token.

The records are written as the lease scripts write them (``lease:<task id>`` with its
delivery tag; the tag in kombu's ``unacked_index`` while the message is held; the
execution lease ``run:<task id>`` as ``fence|holder|acquired ms``)."""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.core.management import call_command

from celery_explicit import message_lease, redis_state


@pytest.fixture
def records(redis_client: redis.Redis) -> Iterator[dict[str, Any]]:
    from tests.celery_app import app

    with app.connection_for_read() as conn:
        index = message_lease.unacked_index_key(conn.default_channel)
    prefix = redis_state.prefix()
    held, done, running = (f"{name}-{uuid.uuid4()}" for name in ("held", "done", "running"))
    tags = {held: f"tag-{uuid.uuid4()}", done: f"tag-{uuid.uuid4()}"}
    fence = 1234567890123456
    for task_id, tag in tags.items():
        redis_client.hset(
            f"{prefix}lease:{task_id}",
            mapping={
                "owner": "worker-host-1:4242",
                "deadline_ms": int(redis_client.time()[0]) * 1000 + 30_000,
                "extensions": 3,
                "tag": tag,
            },
        )
        redis_client.pexpire(f"{prefix}lease:{task_id}", 30_000)
    # Only the held one is still unacknowledged; the other's ack removed its tag.
    redis_client.zadd(index, {tags[held]: 1.0})
    redis_client.set(
        f"{prefix}run:{running}", f"{fence}|worker-host-1:4243|1700000000000", px=30_000
    )
    try:
        yield {"held": held, "done": done, "running": running, "fence": fence}
    finally:
        redis_client.zrem(index, tags[held])
        redis_client.delete(
            f"{prefix}lease:{held}", f"{prefix}lease:{done}", f"{prefix}run:{running}"
        )


def listing(*args: str) -> list[str]:
    out = io.StringIO()
    call_command("explicit_leases", *args, stdout=out)
    return out.getvalue().splitlines()


def test_leases_of_acknowledged_messages_are_left_out_or_marked(records: dict[str, Any]) -> None:
    lines = listing()
    text = "\n".join(lines)
    assert records["held"] in text
    assert records["done"] not in text
    # (Records other tests' workers left may be counted too: they are done as well.)
    assert "lease record(s) of messages already acknowledged not shown: --all" in text
    held = next(line for line in lines if records["held"] in line)
    assert held.rstrip().endswith("held")
    marked = listing("--all")
    done = next(line for line in marked if records["done"] in line)
    assert done.rstrip().endswith("acked (done)")


def test_columns_fit_a_sixteen_digit_fence(records: dict[str, Any]) -> None:
    lines = listing()
    header = next(line for line in lines if "fence" in line)
    row = next(line for line in lines if records["running"] in line)
    fence = str(records["fence"])
    assert fence in row
    # Right-aligned under its header, and the next column starts after it.
    assert row.index(fence) + len(fence) == header.index("fence") + len("fence")
    for column in ("age", "left"):
        assert header.index(column) > row.index(fence) + len(fence)
    assert row.index("worker-host-1:4243") == header.index("owner")
