"""Pieces of the outbox that need no service: payload checks, durations, the wake-up."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.core.management import CommandError, call_command

from celery_explicit import BadInput
from django_outbox.management.arguments import parse_duration
from django_outbox.outbox.events import check_json
from django_outbox.outbox.relay.loop import ListenWakeup, Relay, Wakeup


@pytest.mark.parametrize(
    "value",
    [
        {},
        {"a": 1, "b": [1.5, None, True, "x", {"c": []}]},
        [1, (2, 3)],
        "é",
        10**30,
    ],
)
def test_plain_json_is_accepted(value: object) -> None:
    check_json("shop.t", "kwargs", value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"at": datetime(2024, 1, 1, tzinfo=UTC)}, "kwargs['at'] is a datetime.datetime"),
        ({"amount": Decimal("1.10")}, "kwargs['amount'] is a decimal.Decimal"),
        ({"lines": [{"qty": 1}, {"qty": {1}}]}, "kwargs['lines'][1]['qty'] is a builtins.set"),
        ({1: "a"}, "kwargs[1] has a int key, not a str"),
        ({"x": float("inf")}, "kwargs['x'] is inf, not a JSON number"),
        ({"x": "a\x00"}, "kwargs['x'] contains a NUL character"),
    ],
)
def test_the_first_value_that_is_not_json_is_named(value: object, message: str) -> None:
    with pytest.raises(BadInput) as caught:
        check_json("shop.t", "kwargs", value)
    assert str(caught.value).startswith(f"Task shop.t: outbox payload {message}")
    assert caught.value.task_name == "shop.t"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("7d", timedelta(days=7)),
        ("12h", timedelta(hours=12)),
        ("30m", timedelta(minutes=30)),
        ("90s", timedelta(seconds=90)),
        ("2w", timedelta(weeks=2)),
        ("3", timedelta(days=3)),
        ("0.5d", timedelta(hours=12)),
    ],
)
def test_retention_durations(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "7 days", "-1d", "d", "1y"])
def test_bad_retention_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        parse_duration(text)


def test_without_a_channel_the_relay_polls() -> None:
    relay = Relay(notify_channel="", poll_interval=0.2)
    wakeup = relay.wakeup()
    assert type(wakeup) is Wakeup
    assert not isinstance(wakeup, ListenWakeup)
    assert wakeup.kind == "polling"
    started = time.monotonic()
    wakeup.wait(0.2)
    assert time.monotonic() - started > 0.15  # it waited: no wake-up but the poll


def test_stop_ends_a_poll_wait_at_once() -> None:
    relay = Relay(notify_channel="", poll_interval=60)
    wakeup = relay.wakeup()
    threading.Timer(0.1, relay.stop).start()
    started = time.monotonic()
    wakeup.wait(60)
    assert time.monotonic() - started < 5
    assert relay.stopping


@pytest.mark.parametrize(
    ("command", "option", "value", "message"),
    [
        ("explicit_relay", "--poll-interval", "0", "above 0, got 0"),
        ("explicit_relay", "--poll-interval", "-1", "above 0, got -1"),
        ("explicit_relay", "--poll-interval", "nan", "above 0, got nan"),
        ("explicit_relay", "--poll-interval", "soon", "a number of seconds, got 'soon'"),
        ("explicit_relay", "--batch-size", "0", "at least 1, got 0"),
        ("explicit_prune", "--batch-size", "-5", "at least 1, got -5"),
    ],
)
def test_bad_command_values_are_refused_by_name(
    command: str, option: str, value: str, message: str
) -> None:
    # Before anything runs: a zero poll interval would spin, a negative one crash select().
    extra = ["--table", "outbox", "--older-than", "7d"] if command == "explicit_prune" else []
    with pytest.raises(CommandError, match=rf"argument {option}: must be .*{message}"):
        call_command(command, *extra, option, value)
