"""What a prepared outbox message's label says, and what a relay reads of it
(``django_outbox.outbox.prepared``): no database, no broker."""

from __future__ import annotations

import json

import pytest

from celery_explicit.versions import __version__
from django_outbox.outbox import prepared


def test_the_label_names_the_layout_and_the_writer() -> None:
    label = prepared.format_label()
    assert label == f"{prepared.FORMAT} celery-explicit {__version__}"
    assert prepared.readable(label)
    assert (
        prepared.version_of(label) == f"celery-explicit {__version__} (format {prepared.FORMAT!r})"
    )


@pytest.mark.parametrize(
    ("label", "named"),
    [
        (
            "kombu-redis-json/2 celery-explicit 9.0",
            "celery-explicit 9.0 (format 'kombu-redis-json/2')",
        ),
        ("", "an unknown writer (format '?')"),
        (
            "kombu-redis-json/1x celery-explicit 0.1",
            "celery-explicit 0.1 (format 'kombu-redis-json/1x')",
        ),
    ],
)
def test_another_layout_is_not_read_and_its_writer_is_named(label: str, named: str) -> None:
    assert not prepared.readable(label)
    assert prepared.version_of(label) == named


@pytest.mark.parametrize(
    "text", ["", "queue", "queue\n{}", "\n{\n}", "queue\n{\n}\nmore", "queue\nnot json\n{}"]
)
def test_a_text_not_in_three_lines_is_unreadable(text: str) -> None:
    with pytest.raises(prepared.Unreadable, match="kombu-redis-json/1"):
        prepared.splice(text, 1.0, "tag")


def test_the_splice_puts_the_publish_values_at_their_places() -> None:
    # A header whose value reads like the end of the headers: the splice does not look.
    note = '"a \\"}, \\"properties\\": {"'
    text = f'q\n{{"body": "e30=", "headers": {{"id": "1", "note": {note}\n{{"priority": 0'
    key, payload = prepared.splice(text, 1765000000.5, "tag-1")
    message = json.loads(payload)
    assert key == "q"
    assert message["headers"] == {
        "id": "1",
        "note": 'a "}, "properties": {',
        "explicit_sent_at": 1765000000.5,
    }
    assert message["properties"] == {
        "priority": 0,
        "timestamp": 1765000000,
        "delivery_tag": "tag-1",
    }
