from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from django_outbox import times


def test_a_time_is_shown_in_utc_to_the_millisecond() -> None:
    at = datetime(2026, 12, 2, 9, 19, 45, 160999, tzinfo=timezone(timedelta(hours=2)))
    assert times.shown(at) == "2026-12-02 07:19:45.160 UTC"
    assert times.shown(None) == "-"


def test_json_times_carry_their_offset() -> None:
    at = datetime(2026, 12, 2, 7, 20, 7, 447000, tzinfo=UTC)
    assert times.iso(at) == "2026-12-02T07:20:07.447+00:00"
    assert datetime.fromisoformat(times.iso(at) or "") == at
    assert times.iso(datetime(2026, 12, 2, 7, 20, 7)) == "2026-12-02T07:20:07.000+00:00"
    assert times.iso(None) is None
