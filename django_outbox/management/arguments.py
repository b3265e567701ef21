"""Argument types shared by the app's commands: a bad value is refused by name at once."""

from __future__ import annotations

import argparse
import math
import re
from datetime import timedelta


def positive_int(value: str) -> int:
    """An integer of at least 1 (a batch size)."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def positive_seconds(value: str) -> float:
    """A finite number of seconds above zero (a poll interval)."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {value}")
    return seconds


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")


def parse_duration(text: str) -> timedelta:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"90s"``, ``"2w"``; a bare number is days."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(
            f"cannot read {text!r} as a duration: use a number with s, m, h, d or w "
            "(a bare number is days), e.g. 7d"
        )
    number, unit = match.groups()
    return timedelta(seconds=float(number) * _UNITS[unit or "d"])
