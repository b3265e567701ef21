"""One row per scenario: what was injected, what the history says, and whether the
negative control showed the failure. Rows are appended to a JSON-lines file as the
scenarios run; ``python -m tests.chaos.report [FILE]`` prints them as the table.

A scenario whose invariant did not hold, or whose negative control did not show the
failure it exists to show, fails (the test asserts ``row.ok``).

Each scenario is named after its fault, as its test file is (``kills (redis)`` is
``test_kills.py`` on Redis); the table also shows the short id docs/reliability.md
lists it under.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.support.scale import SCALE, scaled

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["SCALE", "Row", "results_file", "scaled"]


def results_file() -> Path:
    return Path(os.environ.get("EXPLICIT_CHAOS_RESULTS", ROOT / ".chaos" / f"{SCALE}.jsonl"))


#: The short id of each scenario in docs/reliability.md, in that table's order. A label
#: for the reader only: rows are keyed by the scenario's name.
SHORT_IDS = {
    "kills": "R1",
    "broker restarts": "R2",
    "stopped task": "R3",
    "paused lock holder": "R4",
    "broker outage": "R5",
    "poison messages": "R6",
    "retry storm": "R7",
    "postgres restarts": "R8",
    "host partitions": "R9",
    "unexpected bodies": "R10",
    "rolling deploys": "R11",
    "throughput under kills": "P6",
}


@dataclass
class Row:
    #: Named after the fault, with the broker in brackets where it runs on several:
    #: "kills (redis)".
    scenario: str
    fault: str
    faults: int
    jobs: int
    lost: int
    duplicates: int
    #: The scenario's own figures ("redelivered within 6.2 s", "p99 attempt gap").
    figures: dict[str, object] = field(default_factory=dict)
    #: The invariant held (0 lost, 0 duplicates and the scenario's own).
    holds: bool = False
    #: What the negative control showed, in words, and whether it showed the failure.
    control: str = "-"
    control_failed: bool = True
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.holds and self.control_failed

    def save(self) -> None:
        path = results_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {**asdict(self), "ok": self.ok, "scale": SCALE, "at": time.time()}
        with path.open("a") as out:
            out.write(json.dumps(record) + "\n")


def short_id(scenario: str) -> str:
    return SHORT_IDS.get(scenario.split(" (")[0], "-")


def order(scenario: str) -> tuple[int, str]:
    """The order of docs/reliability.md's table; a scenario it does not list comes last."""
    names = list(SHORT_IDS)
    name = scenario.split(" (")[0]
    return (names.index(name) if name in names else len(names), scenario)


def table(rows: list[dict[str, object]]) -> str:
    head = "| # | scenario | fault | faults | jobs | lost | dup | figures | negative control | ok |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        figures = row.get("figures") or {}
        shown = "; ".join(f"{k} {v}" for k, v in figures.items())  # type: ignore[union-attr]
        scenario = str(row["scenario"])
        lines.append(
            f"| {short_id(scenario)} | {scenario} | {row['fault']} | {row['faults']} | "
            f"{row['jobs']} | {row['lost']} | {row['duplicates']} | {shown} | "
            f"{row['control']} | {'yes' if row['ok'] else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> int:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else results_file()
    if not path.exists():
        print(f"no results in {path}: run scripts/chaos first", file=sys.stderr)
        return 1
    latest: dict[str, dict[str, object]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        latest[str(row["scenario"])] = row  # the last run of each scenario
    rows = sorted(latest.values(), key=lambda r: order(str(r["scenario"])))
    print(table(rows))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
