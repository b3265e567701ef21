"""The management commands' arguments: retention durations, and values refused by name
before anything runs."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command

from django_outbox.management.arguments import parse_duration


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
