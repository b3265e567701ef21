"""Publisher confirms on RabbitMQ: a message the broker refuses is never taken for sent.

The broker refuses every publish to a queue under a policy of ``max-length`` 0 and
``overflow: reject-publish`` (a policy, not queue arguments: Celery declares the queue
as it publishes, with none): with ``confirm_publish`` it says so (a ``basic.nack``),
without it the message is dropped in silence.

- The relay: with confirms the refused event stays pending, its error recorded, and is
  published once the queue takes messages again. Control, without confirms: the event
  is marked published and its message is gone.
- A retry: the worker publishes the job's next message before it acknowledges the
  running one. With confirms a refused retry is not acknowledged away (the message is
  requeued) and the job ends once the queue takes messages. Control, without
  confirms: the retry vanishes, the running message is acknowledged, the job is lost.
"""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Iterator

import pytest
from django.db import transaction
from kombu import Connection, Exchange, Queue

from django_outbox.models import OutboxEvent, OutboxStatus
from django_outbox.outbox.events import publish_event
from django_outbox.outbox.relay.loop import Relay
from tests.conftest import RABBITMQ_URL
from tests.support.waiting import wait_for
from tests.testapp.models import Counter
from tests.testapp.tasks import RetriesUntilHealed

pytestmark = pytest.mark.django_db(transaction=True)

REFUSING = '{"max-length": 0, "overflow": "reject-publish"}'


def declare(name: str) -> None:
    with Connection(RABBITMQ_URL) as conn:
        Queue(name, Exchange(name), name)(conn.channel()).declare()


def refuse(name: str) -> None:
    """From now on the broker refuses every message for queue ``name``."""
    subprocess.run(
        ["rabbitmqctl", "set_policy", "--apply-to", "queues", name, f"^{name}$", REFUSING],
        check=True,
        capture_output=True,
    )
    wait_for(lambda: policy_of(name) == name, timeout=10, what=f"the policy on {name}")


def accept(name: str) -> None:
    subprocess.run(["rabbitmqctl", "clear_policy", name], check=True, capture_output=True)
    wait_for(lambda: policy_of(name) != name, timeout=10, what=f"no policy on {name}")


def policy_of(name: str) -> str:
    listed = subprocess.run(
        ["rabbitmqctl", "list_queues", "-q", "--no-table-headers", "name", "policy"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for line in listed.splitlines():
        queue, _, policy = line.partition("\t")
        if queue == name:
            return policy.strip()
    return ""


def depth(name: str) -> int:
    with Connection(RABBITMQ_URL) as conn:
        _name, count, _consumers = conn.default_channel.queue_declare(name, passive=True)
    return int(count)


def drop_pools(app) -> None:  # type: ignore[no-untyped-def]
    """Forget the app's connection and producer pools, so the next publish takes the
    pools of the broker settings of that moment. Never closed: they are kombu's
    process-wide pools, and a closed one refuses every later test's publish through
    it ("Acquire on closed pool")."""
    app._pool = None
    app.amqp._producer_pool = None


@pytest.fixture
def rabbitmq_app(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The tests' Celery app on RabbitMQ; a queue name of this test's own, deleted after."""
    from tests.celery_app import app

    name = f"confirms-{uuid.uuid4().hex[:8]}"
    monkeypatch.setitem(app.conf, "broker_url", RABBITMQ_URL)
    monkeypatch.setitem(app.conf, "broker_write_url", RABBITMQ_URL)
    monkeypatch.setitem(app.conf, "broker_transport_options", {})
    drop_pools(app)
    yield name
    subprocess.run(["rabbitmqctl", "clear_policy", name], check=False, capture_output=True)
    # Before monkeypatch puts the broker back: the next pool is made from it then.
    drop_pools(app)
    with Connection(RABBITMQ_URL) as conn, contextlib.suppress(Exception):
        conn.channel().queue_delete(name)


def relay_into_a_refusing_queue(name: str, confirms: bool) -> OutboxEvent:
    from tests.celery_app import app

    app.conf.broker_transport_options = {"confirm_publish": confirms}
    declare(name)
    refuse(name)
    with transaction.atomic():
        event_id = publish_event("tests.note", {"name": "refused"}, options={"queue": name})
    Relay(poll_interval=0.1).relay_batch()
    return OutboxEvent.objects.get(event_id=event_id)


def test_with_confirms_a_refused_event_stays_pending_until_the_broker_takes_it(
    rabbitmq_app: str,
) -> None:
    event = relay_into_a_refusing_queue(rabbitmq_app, confirms=True)
    # Backpressure, not the event's fault: no attempt spent, so it is never exhausted.
    assert (event.status, event.attempts) == (OutboxStatus.PENDING, 0)
    assert event.last_error.startswith("django_outbox.outbox.relay.publish.BrokerRefused: ")
    assert "basic.nack" in event.last_error, event.last_error
    # The queue takes messages again: the same event is published, once.
    accept(rabbitmq_app)
    OutboxEvent.objects.filter(pk=event.pk).update(available_at=event.created_at)
    Relay(poll_interval=0.1).relay_batch()
    assert OutboxEvent.objects.get(pk=event.pk).status == OutboxStatus.PUBLISHED
    assert depth(rabbitmq_app) == 1


def test_negative_control_without_confirms_a_refused_event_is_marked_published(
    rabbitmq_app: str,
) -> None:
    event = relay_into_a_refusing_queue(rabbitmq_app, confirms=False)
    assert event.status == OutboxStatus.PUBLISHED
    assert depth(rabbitmq_app) == 0  # and its message is gone


def retry_into_a_refusing_queue(start_worker, redis_client, queue: str, confirms: bool) -> str:  # type: ignore[no-untyped-def]
    """A job whose first execution fails while the broker refuses its queue's messages:
    its retry is refused. Then the queue takes messages and the job is healed."""
    env = {
        "EXPLICIT_TEST_BROKER_URL": RABBITMQ_URL,
        "EXPLICIT_TEST_CONFIRM_PUBLISH": str(int(confirms)),
    }
    worker = start_worker(concurrency=1, extra_env=env)
    name = uuid.uuid4().hex[:8]
    Counter.objects.create(name=name)
    with Connection(RABBITMQ_URL) as conn:
        RetriesUntilHealed().apply_async(kwargs={"name": name}, queue=queue, connection=conn)
    started = f"started:{name}"
    wait_for(
        lambda: redis_client.llen(started) == 1,
        timeout=30,
        what="the first execution",
        on_timeout=lambda: worker.log()[-3000:],
    )
    refuse(queue)
    redis_client.set(f"go:{name}:1", 1, ex=120)  # it fails now: its retry is refused
    try:
        # Refused and confirmed: the message is requeued and runs again. Unconfirmed:
        # nothing comes back.
        wait_for(lambda: redis_client.llen(started) >= 2, timeout=6, what="a second execution")
        again = True
    except TimeoutError:
        again = False
    accept(queue)
    redis_client.set(f"healed:{name}", 1, ex=120)
    redis_client.set(f"go:{name}:2", 1, ex=120)
    try:
        wait_for(
            lambda: Counter.objects.get(name=name).value == 1,
            # Run again, it applies within seconds; not run again, nothing will come.
            timeout=15 if again else 4,
            what="the effect",
        )
    except TimeoutError:
        if not again and depth(queue) == 0:
            return "job lost"
        return f"unexpected: not applied (ran again: {again}); {worker.log()[-4000:]}"
    return "ran again and applied" if again else "unexpected: applied without running again"


@pytest.mark.worker
@pytest.mark.parametrize(
    ("confirms", "expected"),
    [(True, "ran again and applied"), (False, "job lost")],
    ids=["confirms", "negative-control"],
)
def test_a_retry_the_broker_refuses_is_not_acknowledged_away(
    start_worker, redis_client, queue: str, confirms: bool, expected: str
) -> None:
    try:
        assert retry_into_a_refusing_queue(start_worker, redis_client, queue, confirms) == expected
    finally:
        subprocess.run(["rabbitmqctl", "clear_policy", queue], check=False, capture_output=True)
        with Connection(RABBITMQ_URL) as conn, contextlib.suppress(Exception):
            conn.channel().queue_delete(queue)
