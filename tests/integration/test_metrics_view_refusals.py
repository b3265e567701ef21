"""The Django metrics view when a source refuses: a 503 that names the source, and one
log line, never a 500.

The refusals are real: a Redis of the test's own with an ACL user that may run no
command, the same user with a wrong password, and a database whose dead-letter table
is missing. The control: the same view on the same server with the right broker
answers 200.
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from django_outbox.models import DeadLetter
from tests.support.servers import PrivateRedis

pytestmark = pytest.mark.django_db(transaction=True)

PATH = "/admin/django_outbox/dashboard/metrics/"
TOKEN = "s3cret-scrape-token"
USER, PASSWORD = "scraper", "scraper-password"


def get(url: str) -> tuple[int, str]:
    request = urllib.request.Request(url)
    request.add_header("Authorization", f"Bearer {TOKEN}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def refusing_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A Redis whose user ``scraper`` may log in and run nothing."""
    server = PrivateRedis(tmp_path / "redis", durable=False).start()
    client = server.client()
    client.execute_command("ACL", "SETUSER", USER, "on", f">{PASSWORD}", "~*", "-@all")
    client.close()
    try:
        yield server
    finally:
        server.stop()


def use_broker(monkeypatch: Any, url: str) -> None:
    from tests.celery_app import app

    monkeypatch.setitem(app.conf, "broker_url", url)
    monkeypatch.setitem(app.conf, "broker_read_url", url)


def refusal_lines(caplog: Any) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "django_outbox.incident.metrics_view"
    ]


@pytest.mark.parametrize(
    ("password", "error"),
    [(PASSWORD, "NoPermissionError"), ("wrong-password", "AuthenticationError")],
    ids=["no-permission", "wrong-password"],
)
def test_a_redis_that_refuses_is_a_503(
    live_server: Any,
    settings: Any,
    monkeypatch: Any,
    caplog: Any,
    refusing_redis: PrivateRedis,
    password: str,
    error: str,
) -> None:
    settings.EXPLICIT_METRICS_TOKEN = TOKEN
    url = live_server.url + PATH
    use_broker(monkeypatch, f"redis://{USER}:{password}@127.0.0.1:{refusing_redis.port}/0")
    with caplog.at_level(logging.ERROR, logger="django_outbox.incident.metrics_view"):
        status, text = get(url)
    assert status == 503, text
    assert "the broker refused" in text and error in text
    lines = refusal_lines(caplog)
    assert len(lines) == 1 and "broker" in lines[0] and error in lines[0], lines

    # Control: the server's default user can read the queues.
    use_broker(monkeypatch, f"redis://127.0.0.1:{refusing_redis.port}/0")
    assert get(url)[0] == 200


def test_a_database_error_is_a_503(live_server: Any, settings: Any, caplog: Any) -> None:
    settings.EXPLICIT_METRICS_TOKEN = TOKEN
    url = live_server.url + PATH
    table = DeadLetter._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f'ALTER TABLE "{table}" RENAME TO "{table}_away"')
    try:
        with caplog.at_level(logging.ERROR, logger="django_outbox.incident.metrics_view"):
            status, text = get(url)
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'ALTER TABLE "{table}_away" RENAME TO "{table}"')
    assert status == 503, text
    assert "the database refused" in text and "ProgrammingError" in text
    lines = refusal_lines(caplog)
    assert len(lines) == 1 and "database" in lines[0], lines
    assert get(url)[0] == 200
