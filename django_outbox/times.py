"""The one way a time is written for a person, and the one way for a machine.

Every page, list, sentence and command of the incident tools shows a time as
``2026-12-02 07:19:45.160 UTC``: milliseconds (attempts a few milliseconds apart must be
told apart), in UTC whatever ``TIME_ZONE`` says (worker logs, Redis and PostgreSQL
write UTC, and an incident is read across them). JSON carries ISO 8601 with its
offset (``2026-12-02T07:19:45.160+00:00``), which every parser reads back exactly.
"""

from __future__ import annotations

from datetime import UTC, datetime

#: What a missing time is shown as.
NONE = "-"


def shown(at: datetime | None) -> str:
    """``at`` for a person: ``2026-12-02 07:19:45.160 UTC``."""
    if at is None:
        return NONE
    if at.tzinfo is not None:
        at = at.astimezone(UTC)
    return at.strftime("%Y-%m-%d %H:%M:%S.") + f"{at.microsecond // 1000:03d} UTC"


def iso(at: datetime | None) -> str | None:
    """``at`` for JSON: ISO 8601 to the millisecond, with its offset (UTC)."""
    if at is None:
        return None
    if at.tzinfo is None:
        # Naive times here come from USE_TZ=False projects, whose database stores UTC.
        at = at.replace(tzinfo=UTC)
    return at.astimezone(UTC).isoformat(timespec="milliseconds")
