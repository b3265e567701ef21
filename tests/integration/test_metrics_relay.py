"""The relay serves its own counters and publish lag (``explicit_relay --metrics-port``):
one process, its own registry, scraped over HTTP."""

from __future__ import annotations

import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from django_outbox.outbox.dispatch import dispatch
from tests.support.ports import free_port
from tests.support.waiting import wait_for
from tests.testapp.tasks import Increment

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_relay_serves_what_it_published(start_relay, redis_client, queue) -> None:
    from django.db import transaction

    port = free_port()
    relay = start_relay("--metrics-port", str(port))
    assert f"relay metrics on http://127.0.0.1:{port}/metrics" in relay.log()
    with transaction.atomic():
        for i in range(3):
            dispatch(
                Increment(),
                kwargs={"name": f"r{uuid.uuid4().hex[:6]}", "op_id": str(i)},
                durable=True,
                options={"queue": queue},
            )
    published = ("explicit_outbox_published_total", frozenset({("task", "tests.increment")}))
    samples = wait_for(
        lambda: (s := scrape(port)).get(published) == 3 and s,
        timeout=20,
        what="three publishes counted",
    )
    assert samples[("explicit_outbox_publish_lag_seconds_count", frozenset())] == 3
    assert redis_client.llen(queue) == 3


def test_a_port_in_use_is_said_and_the_relay_still_publishes(start_relay, queue) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        relay = start_relay("--metrics-port", str(port))
        assert f"relay metrics not served on port {port}" in relay.log()
        assert "outbox relay ready" in relay.log()
