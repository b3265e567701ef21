"""The state store's URL forms beyond one server: a cluster URL naming no node or a
database other than 0 is refused by name before anything connects."""

from __future__ import annotations

import pytest

from celery_explicit import redis_state
from celery_explicit.setting import redis_url_rule


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("redis+cluster:///", "names no cluster node"),
        ("redis+cluster://127.0.0.1:7000/2", "database 0 only"),
    ],
)
def test_a_cluster_url_that_cannot_name_a_cluster_is_refused(url: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        redis_state.cluster_client(url)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "sentinel://10.0.0.1:26379;sentinel://10.0.0.2:26379/0?master_name=m",
        "redis+cluster://10.0.0.1:7000,10.0.0.2:7001",
        "rediss+cluster://10.0.0.1:7000",
    ],
)
def test_the_state_store_accepts_a_server_a_sentinel_group_and_a_cluster(url: str) -> None:
    assert redis_url_rule(url) is None


def test_another_scheme_is_refused_naming_the_ones_accepted() -> None:
    assert "redis+cluster://" in str(redis_url_rule("memcached://127.0.0.1:11211"))
