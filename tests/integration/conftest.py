"""Fixtures shared by the integration tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis


@pytest.fixture
def prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    p = f"explicit-test:{uuid.uuid4().hex[:8]}:"
    yield p
    keys = list(redis_client.scan_iter(match=f"{p}*"))
    if keys:
        redis_client.delete(*keys)
