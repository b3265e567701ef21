"""``celery_explicit.conf.Settings`` is the table of settings: docs/reference.md shows the
same settings with the same defaults, the defaults obey their own rules, and a value that
cannot be read says which setting it is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from celery_explicit.conf import Settings, settings
from celery_explicit.setting import Relation

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"


def documented() -> dict[str, tuple[str, bool]]:
    """The rows of reference.md's Settings section: name -> (default cell, environment)."""
    text = REFERENCE.read_text()
    section = text[text.index("\n## Settings (") : text.index("\n## System checks")]
    rows: dict[str, tuple[str, bool]] = {}
    for line in section.splitlines():
        if not line.startswith("| `EXPLICIT_"):
            continue
        name_cell, default_cell = (cell.strip() for cell in line.split(" | ")[:2])
        names = re.findall(r"`(EXPLICIT_[A-Z0-9_]+)`", name_cell)
        assert len(names) == 1, f"one setting a row, so its default can be read: {line}"
        assert names[0] not in rows, f"{names[0]} has two rows"
        rows[names[0]] = (default_cell, "*environment*" in name_cell)
    return rows


def test_every_setting_is_documented_with_its_default_and_nothing_else() -> None:
    rows = documented()
    table = Settings.table()
    assert sorted(set(table) - set(rows)) == [], "settings missing from docs/reference.md"
    assert sorted(set(rows) - set(table)) == [], "documented, but no such setting"
    for name, setting in table.items():
        default, environment = rows[name]
        assert default.startswith(f"`{setting.shown}`"), (
            f"{name}: reference.md shows {default}, the table's default is {setting.shown}"
        )
        assert environment is setting.env, f"{name}: the *environment* mark"


def test_every_default_obeys_its_own_rule() -> None:
    for name, setting in Settings.table().items():
        assert setting.problems(setting.default) == [], name
    assert settings.problems() == []


def test_every_relation_names_a_setting_and_an_operator() -> None:
    attributes = {s.attribute for s in Settings.table().values()}
    relations: list[Relation] = [r for s in Settings.table().values() for r in s.relations]
    assert {r.other for r in relations} <= attributes
    assert {(r.op, r.other) for r in relations} >= {
        (">", "outbox_reconcile_after"),
        (">=", "outbox_backoff_base"),
    }


def test_the_renamed_settings_keep_their_documented_names() -> None:
    table = Settings.table()
    assert table["EXPLICIT_REDIS_URL"].attribute == "redis_url_setting"
    assert table["EXPLICIT_CELERY_APP"].attribute == "celery_app_path"


def test_reading_a_value_that_cannot_be_cast_names_the_setting() -> None:
    with (
        override_settings(EXPLICIT_OUTBOX_BATCH_SIZE="abc"),
        pytest.raises(ImproperlyConfigured, match=r"EXPLICIT_OUTBOX_BATCH_SIZE='abc' cannot"),
    ):
        settings.outbox_batch_size  # noqa: B018


@pytest.mark.parametrize(
    ("value", "read"),
    [("off", False), ("0", False), ("", False), ("True", True), ("yes", True), (0, False)],
)
def test_a_switch_reads_the_words_it_knows(value: object, read: bool) -> None:
    with override_settings(EXPLICIT_START_DESPITE_CHECK_ERRORS=value):
        assert settings.start_despite_check_errors is read
