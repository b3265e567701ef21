"""Argument types shared by the app's commands: a bad value is refused by name at once."""

from __future__ import annotations

import argparse
import math


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
