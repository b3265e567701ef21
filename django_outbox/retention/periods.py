"""The tables ``explicit_prune`` knows, the setting that keeps each, and how a retention
reads: what the prune, the ledger's floor and the checks all name the same way."""

from __future__ import annotations

import math
from collections.abc import Iterable

from django_outbox.conf import settings

__all__ = ["TABLES", "human", "retention", "setting_name", "tables"]

#: The tables ``explicit_prune`` knows, in the order it prunes them.
TABLES = ("attempts", "fences", "dead_letters", "outbox", "ledger", "cancellations")


def setting_name(table: str) -> str:
    return f"EXPLICIT_RETAIN_{table.upper()}"


def retention(table: str) -> float:
    """The table's retention in seconds."""
    return float(getattr(settings, f"retain_{table}"))


def tables(names: Iterable[str] | None) -> list[str]:
    """``names`` in pruning order (all tables when None)."""
    chosen = set(names or TABLES)
    return [table for table in TABLES if table in chosen]


def human(seconds: float) -> str:
    """``90330`` -> ``"1d 1h 5m 30s"``: how operators read retentions."""
    if not math.isfinite(seconds):
        return "forever"
    left = round(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size:
            parts.append(f"{left // size}{unit}")
            left %= size
    return " ".join(parts) or f"{seconds:g}s"
