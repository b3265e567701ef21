"""A task's ``sensitive`` fields on every path that writes evidence, with a real worker,
PostgreSQL and Redis: an argument ``run()`` no longer takes (bad input), a retryable
error quoting the card (Celery's retry line, the RETRY state), a permanent one (the
FAILURE state), the hard time limit, a success (``result_extended`` arguments), and the
relay's and the reconciler's dead letters.

The test searches everything for the card: every row of every django_outbox table, the
worker's log, every value in the test's Redis database (the result backend's too) and
``explain --json``. The control is the same task without the declaration: its card
shows up in each of them, which proves the search finds what is there.
"""

from __future__ import annotations

import io
import json
import time
import uuid
from typing import Any

import pytest
import redis
from django.apps import apps
from django.conf import settings
from django.core.management import call_command
from django.db import transaction

from django_outbox.models import Attempt, DeadLetter, DeadLetterReason, OutboxEvent
from django_outbox.outbox.events import publish_event
from django_outbox.outbox.relay.loop import Relay
from django_outbox.outbox.relay.reconcile import Reconciler
from tests.celery_app import app
from tests.support.waiting import wait_for
from tests.testapp.tasks_redaction import ChargeCard, ChargeCardPlain

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def everything_in_the_database(*, but_outbox_arguments: bool = False) -> str:
    """Every row of every django_outbox model, as text. ``but_outbox_arguments``: an
    outbox row's own args and kwargs are left out (the relay publishes from them)."""
    rows = []
    for model in apps.get_app_config("django_outbox").get_models():
        for row in model.objects.values():
            if but_outbox_arguments and model is OutboxEvent:
                row = {k: v for k, v in row.items() if k not in ("args", "kwargs")}
            rows.append(f"{model.__name__}: {row!r}")
    return "\n".join(rows)


def everything_in_redis(client: redis.Redis) -> str:
    """Every value of every key in the test's Redis database, as text."""
    found = []
    for key in client.scan_iter():
        kind = client.type(key).decode()
        if kind == "string":
            value: Any = client.get(key)
        elif kind == "hash":
            value = client.hgetall(key)
        elif kind == "list":
            value = client.lrange(key, 0, -1)
        elif kind == "set":
            value = client.smembers(key)
        elif kind == "zset":
            value = client.zrange(key, 0, -1)
        else:
            value = kind
        found.append(f"{key!r}: {value!r}")
    return "\n".join(found)


def explained(what: str) -> str:
    out = io.StringIO()
    call_command("explicit_explain", what, "--json", stdout=out)
    return out.getvalue()


def drive_every_worker_path(task: Any, card: str, queue: str) -> dict[str, str]:
    """Send one job down each path; their task ids by path, once every one ended."""
    run = uuid.uuid4().hex[:8]
    ids = {
        # An older producer still sends an argument run() no longer takes.
        "bad_input": app.send_task(
            task.name, kwargs={"ref": f"bi{run}", "card": card, "extra": 1}, queue=queue
        ).id,
        "transient": task.apply_async(
            kwargs={"ref": f"tr{run}", "card": card, "mode": "transient"}, queue=queue
        ).id,
        "declined": task.apply_async(
            kwargs={"ref": f"de{run}", "card": card, "mode": "declined"}, queue=queue
        ).id,
        "hard_limit": task.apply_async(
            kwargs={"ref": f"hl{run}", "card": card, "mode": "hang"}, queue=queue
        ).id,
        # Positionally: the card is matched to its parameter by position.
        "succeeded": task.apply_async(args=[f"ok{run}", card], queue=queue).id,
    }
    reasons = {
        "bad_input": DeadLetterReason.BAD_INPUT,
        "transient": DeadLetterReason.EXHAUSTED,
        "declined": DeadLetterReason.PERMANENT,
        "hard_limit": DeadLetterReason.MAX_RUN_TIME,
    }
    for path, reason in reasons.items():
        wait_for(
            lambda i=ids[path], r=reason: DeadLetter.objects.filter(task_id=i, reason=r).exists(),
            timeout=60,
            what=f"the {path} dead letter of {task.name}",
        )
    wait_for(
        lambda: Attempt.objects.filter(task_id=ids["succeeded"], outcome="succeeded").exists(),
        what=f"the success of {task.name}",
    )
    return ids


def results_stored(client: redis.Redis, ids: dict[str, str]) -> None:
    """Wait until the backend holds each job's final state (the hard limit's is
    written by the main process after its dead letter)."""
    finals = {"bad_input": "FAILURE", "transient": "FAILURE", "declined": "FAILURE"}
    finals |= {"hard_limit": "FAILURE", "succeeded": "SUCCESS"}
    for path, state in finals.items():
        wait_for(
            lambda i=ids[path], s=state: (
                json.loads(client.get(f"celery-task-meta-{i}") or b"{}").get("status") == s
            ),
            timeout=30,
            what=f"the {state} of the {path} job in the result backend",
        )


def test_a_sensitive_card_is_nowhere_and_the_controls_is_everywhere(
    start_worker, queue, redis_client
) -> None:
    secret = f"4111{uuid.uuid4().int % 10**12:012d}"
    clear = f"5500{uuid.uuid4().int % 10**12:012d}"
    worker = start_worker(
        extra_env={
            "CELERY_RESULT_BACKEND": settings.REDIS_URL,
            "EXPLICIT_TEST_RESULT_EXTENDED": "1",
        }
    )
    # Every state the backend stores is also published on its key: the STARTED ones,
    # overwritten by the final state, are read here.
    states = redis.Redis.from_url(settings.REDIS_URL).pubsub()
    states.psubscribe("celery-task-meta-*")
    hidden = drive_every_worker_path(ChargeCard(), secret, queue)
    shown = drive_every_worker_path(ChargeCardPlain(), clear, queue)
    results_stored(redis_client, hidden)
    results_stored(redis_client, shown)
    stored_states = []
    while (message := states.get_message(timeout=1.0)) is not None:
        if message["type"] == "pmessage":
            stored_states.append(json.loads(message["data"]))
    states.close()
    started = {s["task_id"]: json.dumps(s) for s in stored_states if s["status"] == "STARTED"}
    assert set(hidden.values()) - {hidden["bad_input"]} <= set(started), started
    assert not any(secret in text for text in started.values())
    assert clear in started[shown["succeeded"]]
    # The retry lines of both tasks are written before their last attempt's row.
    log = worker.log()
    assert log.count(" retry: Retry in ") >= 2, log

    database = everything_in_the_database()
    backend = everything_in_redis(redis_client)
    explanations = "\n".join(explained(i) for i in hidden.values())
    assert secret not in database
    assert secret not in log
    assert secret not in backend
    assert secret not in explanations
    # What stands in for it, so the evidence still says a card was there.
    letter = DeadLetter.objects.get(task_id=hidden["bad_input"])
    assert letter.kwargs == {"ref": letter.kwargs["ref"], "card": "[redacted]", "extra": 1}
    retry_line = next(
        ln for ln in log.splitlines() if hidden["transient"] in ln and " retry: " in ln
    )
    assert "gateway timed out charging card [redacted]" in retry_line
    assert json.loads(redis_client.get(f"celery-task-meta-{hidden['succeeded']}"))["args"][1] == (
        "[redacted]"
    )

    # The control: each place searched holds the undeclared card.
    clear_letter = DeadLetter.objects.get(task_id=shown["bad_input"])
    assert clear_letter.kwargs["card"] == clear
    assert clear in DeadLetter.objects.get(task_id=shown["hard_limit"]).raw_body
    assert clear in database
    clear_retry = next(
        ln for ln in log.splitlines() if shown["transient"] in ln and " retry: " in ln
    )
    assert clear in clear_retry
    for path in ("transient", "declined", "succeeded"):
        assert clear in (redis_client.get(f"celery-task-meta-{shown[path]}") or b"").decode(), path
    assert clear in backend


def test_the_relays_and_the_reconcilers_dead_letters_are_redacted(queue, redis_client) -> None:
    secret = f"4111{uuid.uuid4().int % 10**12:012d}"
    clear = f"5500{uuid.uuid4().int % 10**12:012d}"
    events = {}
    for task, card in ((ChargeCard, secret), (ChargeCardPlain, clear)):
        # An event written by an older producer: the relay refuses its arguments.
        bad = OutboxEvent.objects.create(
            task_name=task.name,
            kwargs={"ref": "r", "card": card, "extra": 1},
            options={"queue": queue},
        )
        with transaction.atomic():
            lost = publish_event(
                task.name,
                {"ref": f"lost-{uuid.uuid4().hex[:8]}", "card": card},
                options={"queue": queue},
            )
        events[task.name] = (str(bad.event_id), lost)
    assert Relay(notify_channel="").drain().dead_lettered == 2
    # Published, then lost by the broker, past the limit of republishes: not received.
    redis_client.delete(queue)
    time.sleep(0.1)
    reconciler = Reconciler(app=app, using="default", after=0.05, limit=0, horizon=3600)
    assert reconciler.run_once().dead_lettered == 2

    for name, (bad, lost) in events.items():
        assert DeadLetter.objects.get(task_id=bad).reason == DeadLetterReason.BAD_INPUT
        assert DeadLetter.objects.get(task_id=lost).reason == DeadLetterReason.NOT_RECEIVED, name
    database = everything_in_the_database(but_outbox_arguments=True)
    assert secret not in database
    assert secret not in explained(events[ChargeCard.name][1])
    assert DeadLetter.objects.get(task_id=events[ChargeCard.name][1]).kwargs["card"] == "[redacted]"
    # The control.
    assert clear in database
    assert DeadLetter.objects.get(task_id=events[ChargeCardPlain.name][1]).kwargs["card"] == clear
