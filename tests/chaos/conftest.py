"""Fixtures of the chaos suite: the history tables, and a run id per scenario."""

from __future__ import annotations

import uuid

import pytest

from tests.chaos import history


@pytest.fixture
def run_id(transactional_db: None) -> str:
    history.ensure_tables()
    return uuid.uuid4().hex[:10]
