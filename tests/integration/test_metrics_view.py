"""The Django metrics view, scraped over HTTP from a live server and parsed as
Prometheus exposition: what the database and the broker know, behind a bearer token.

Negative controls: no token set -> 404 (the view is off); no header -> 401; a wrong
token -> 403; and nothing a dead letter or an event carries (arguments, payload,
idempotency key) appears in the exposition.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from celery_explicit.headers import SENT_AT_HEADER
from django_outbox.models import DeadLetter, DeadLetterReason, DeadLetterStatus, OutboxEvent
from tests.support.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

PATH = "/admin/django_outbox/dashboard/metrics/"
TOKEN = "s3cret-scrape-token"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def get(url: str, token: str | None = TOKEN) -> tuple[int, str]:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def test_off_without_a_token_and_refused_with_a_wrong_one(live_server: Any, settings: Any) -> None:
    url = live_server.url + PATH
    settings.EXPLICIT_METRICS_TOKEN = ""
    assert get(url)[0] == 404
    settings.EXPLICIT_METRICS_TOKEN = TOKEN
    assert get(url, token=None)[0] == 401
    assert get(url, token="s3cret-scrape-tokeN")[0] == 403
    assert get(url, token="")[0] == 403
    status, text = get(url)
    assert status == 200
    assert value(parse(text), "explicit_metrics_source_up", source="database") == 1


def test_dead_letters_outbox_lag_and_queues(
    live_server: Any, settings: Any, queue: str, redis_client: Any, monkeypatch: Any
) -> None:
    from tests.celery_app import app
    from tests.testapp.tasks import Increment

    settings.EXPLICIT_METRICS_TOKEN = TOKEN
    monkeypatch.setitem(app.conf, "task_default_queue", queue)
    url = live_server.url + PATH
    now = timezone.now()
    for i, (reason, age) in enumerate(
        [
            (DeadLetterReason.PERMANENT, 600),
            (DeadLetterReason.PERMANENT, 60),
            (DeadLetterReason.EXHAUSTED, 30),
        ]
    ):
        DeadLetter.objects.create(
            task_id=f"dl{i}",
            task_name="t",
            reason=reason,
            first_seen=now - dt.timedelta(seconds=age),
            last_attempt=now,
            args=["card-4111-1111"],
            kwargs={"email": "someone@example.com"},
            idempotency_key="charge:order-778",
        )
    DeadLetter.objects.create(  # resolved: not open, not counted
        task_id="done",
        task_name="t",
        reason=DeadLetterReason.BAD_INPUT,
        status=DeadLetterStatus.DISCARDED,
        first_seen=now - dt.timedelta(days=3),
        last_attempt=now,
    )
    event = OutboxEvent.objects.create(task_name="t", kwargs={"email": "someone@example.com"})
    OutboxEvent.objects.filter(pk=event.pk).update(created_at=now - dt.timedelta(seconds=90))
    try:
        for op in ("1", "2"):
            app.tasks[Increment.name].apply_async(kwargs={"name": "q", "op_id": op}, queue=queue)
        oldest = json.loads(redis_client.lindex(queue, -1))
        oldest["headers"][SENT_AT_HEADER] = time.time() - 300
        redis_client.lset(queue, -1, json.dumps(oldest))

        status, text = get(url)
        assert status == 200
        samples = parse(text)
        assert value(samples, "explicit_dead_letters_open", reason="permanent") == 2
        assert value(samples, "explicit_dead_letters_open", reason="exhausted") == 1
        assert value(samples, "explicit_dead_letters_open", reason="bad_input") == 0
        permanent_age = value(
            samples, "explicit_dead_letters_oldest_open_age_seconds", reason="permanent"
        )
        assert permanent_age is not None and 600 <= permanent_age < 660
        assert value(samples, "explicit_outbox_backlog") == 1
        lag = value(samples, "explicit_outbox_lag_seconds")
        assert lag is not None and 90 <= lag < 150
        assert value(samples, "explicit_queue_depth", queue=queue) == 2
        age = value(samples, "explicit_queue_oldest_message_age_seconds", queue=queue)
        assert age is not None and 300 <= age < 360
        assert value(samples, "explicit_metrics_source_up", source="broker") == 1
        # Whole values: a bare "4111" can turn up inside a float (an age of 300.0136411...).
        for secret in ("card-4111-1111", "someone@example.com", "order-778", "charge:"):
            assert secret not in text

        # No relay runs: the lag keeps rising while the event waits.
        time.sleep(1.1)
        later = value(parse(get(url)[1]), "explicit_outbox_lag_seconds")
        assert later is not None and later >= lag + 1

        # A message no ExplicitTask sent: its age is absent, not a made-up number.
        del oldest["headers"][SENT_AT_HEADER]
        redis_client.lset(queue, -1, json.dumps(oldest))
        samples = parse(get(url)[1])
        assert value(samples, "explicit_queue_depth", queue=queue) == 2
        assert value(samples, "explicit_queue_oldest_message_age_seconds", queue=queue) is None
    finally:
        redis_client.delete(queue)


def test_a_rabbitmq_queue_and_a_broker_that_is_down(
    live_server: Any, settings: Any, rabbitmq_queue_with_old_head: str, monkeypatch: Any
) -> None:
    from tests.celery_app import app
    from tests.support.ports import free_port

    queue = rabbitmq_queue_with_old_head
    settings.EXPLICIT_METRICS_TOKEN = TOKEN
    url = live_server.url + PATH

    # The management API refreshes its queue figures every few seconds.
    def aged() -> Samples | None:
        samples = parse(get(url)[1])
        age = value(samples, "explicit_queue_oldest_message_age_seconds", queue=queue)
        return samples if age is not None and age >= 300 else None

    samples = wait_for(aged, timeout=20, interval=1.0, what="the head message's timestamp")
    assert value(samples, "explicit_queue_depth", queue=queue) == 2

    # The broker down: said by source_up, the database's gauges still there.
    down = f"amqp://guest:guest@127.0.0.1:{free_port()}//"
    monkeypatch.setitem(app.conf, "broker_url", down)
    monkeypatch.setitem(app.conf, "broker_read_url", down)
    status, text = get(url)
    samples = parse(text)
    assert status == 200
    assert value(samples, "explicit_metrics_source_up", source="broker") == 0
    assert value(samples, "explicit_metrics_source_up", source="database") == 1
    assert value(samples, "explicit_queue_depth", queue=queue) is None
    assert value(samples, "explicit_outbox_backlog") == 0
