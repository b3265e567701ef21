"""Fixtures of the chaos suite: the history tables, and a run id per scenario."""

from __future__ import annotations

import os
import uuid

import pytest

from tests.chaos import history


@pytest.fixture
def run_id(transactional_db: None) -> str:
    history.ensure_tables()
    # EXPLICIT_CHAOS_RUN_ID replays a run: the unexpected bodies' generator is seeded
    # with it, and every scenario's randomness (kills, pauses) is drawn from it.
    return os.environ.get("EXPLICIT_CHAOS_RUN_ID") or uuid.uuid4().hex[:10]
