"""How many faults a test injects: a short scale in the suite (CI), the full scale under
``scripts/chaos`` (``EXPLICIT_CHAOS=full``), which runs the chaos scenarios and the fault
tests with their full rounds."""

from __future__ import annotations

import os

#: "short" (the suite's default, CI) or "full" (``scripts/chaos``).
SCALE = os.environ.get("EXPLICIT_CHAOS", "short")


def scaled(short: int, full: int) -> int:
    return full if SCALE == "full" else short
