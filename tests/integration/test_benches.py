"""The benchmarks still measure what they say they measure.

A benchmark's references are hand-written copies of our statements (the floor sends
the execution lease's functions and the attempt row by hand): when our side changes,
a copy left behind fails, and a worker's failed jobs only slow a round down. So the
two benchmarks with hand-written references, ``throughput.py --floor`` and
``relay_throughput.py``, and the opcode counts beside the floor
(``opcodes_per_job.py``) and of the relay (``relay_throughput.py --opcodes``) run
here at a tiny scale through their own entry points and must end cleanly: a bench
worker that logged an error makes its benchmark exit non-zero
(``bench.common.check_workers``). Figures are not looked at: no test asserts a timing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import common
from tests.support.processes import run

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.worker

#: The benchmarks' own settings, not the test run's (pytest-django exports its own).
BENCH_ENV = {**os.environ, "DJANGO_SETTINGS_MODULE": "bench.settings"}


def bench(script: str, *args: str) -> str:
    """Run ``bench/<script>`` with ``args`` through its own entry point; its output."""
    return run([sys.executable, f"bench/{script}", *args], timeout=280, cwd=ROOT, env=BENCH_ENV)


@pytest.mark.timeout(300)
def test_throughput_bench_runs_every_side_with_no_failed_job() -> None:
    output = bench("throughput.py", "--floor", "--tasks", "20", "--rounds", "1")
    for line in (
        "P1 ratio",
        "P1a ExplicitTask / floor",
        "floor without lease / floor",
        "floor, lease in main / floor",
        "fenced, no lease call / floor",
    ):
        assert line in output, output


@pytest.mark.timeout(300)
def test_relay_bench_runs_its_references_by_hand() -> None:
    output = bench(
        "relay_throughput.py", *("--events", "200", "--rounds", "1", "--batch-sizes", "50")
    )
    for line in (
        "relay, batch size 50",
        "a relay by hand",
        "its claim and marks alone",
        "relay, prepared messages, batch size 50",
        "the writer's price",
    ):
        assert line in output, output


@pytest.mark.timeout(300)
def test_opcode_bench_counts_each_side_in_the_order_of_what_it_does() -> None:
    output = bench("opcodes_per_job.py", "--jobs", "2", "--top", "5")
    counts = {
        line.split()[0]: int(line.split()[1])
        for line in output.splitlines()
        if line.startswith("  ") and line.split()[0] in ("plain", "floor", "explicit")
    }
    # The floor sends the ExplicitTask's statements by hand, the plain task one update:
    # a tracer that counted nothing, or one side run in place of another, breaks this.
    assert 0 < counts["plain"] < counts["floor"] < counts["explicit"], output
    ours = int(output.split("ours in the ExplicitTask's job: ", 1)[1].split()[0])
    assert 0 < ours < counts["explicit"] - counts["plain"], output


@pytest.mark.timeout(300)
def test_relay_opcode_count_puts_the_prepared_relay_under_the_building_one() -> None:
    output = bench(
        "relay_throughput.py",
        *("--opcodes", "--events", "50", "--batch-sizes", "50", "--top", "40"),
    )
    counts = {
        found[1]: (float(found[2]), float(found[3]))
        for found in re.finditer(
            r"^(relay, [^:]+): ([\d.]+) opcodes an event, ([\d.]+) of them ours", output, re.M
        )
    }
    building = counts["relay, building messages, batch 50"]
    pushed = counts["relay, prepared messages, batch 50"]
    # Each: opcodes an event, then ours among them. The prepared relay builds nothing.
    assert 0 < pushed[1] < pushed[0] < building[0], output
    assert 0 < building[1] < building[0], output
    prepared_part = output.split("relay, prepared messages", 1)[1]
    assert "relay/celery_send.py" in output.split("relay, prepared messages", 1)[0]
    # Nor does it parse the rows' stored arguments (Claimed.call): it pushes the bytes.
    assert "relay/claim.py:parse" not in prepared_part, output


def test_a_worker_that_logged_a_failed_job_stops_the_benchmark(tmp_path: Path) -> None:
    # Negative control for the check above: a worker whose log holds Celery's line for
    # a job that raised.
    log = tmp_path / "worker.log"
    line = "[2026-01-01 00:00:00,000: ERROR/ForkPoolWorker-1] Task bench.floor_update raised"
    with log.open("w") as out:
        worker = subprocess.Popen([sys.executable, "-c", f"print({line!r})"], stdout=out)
        worker.wait(30)
    common._worker_logs[worker.pid] = log
    with pytest.raises(SystemExit, match=r"bench\.floor_update raised"):
        common.check_workers(worker)
    quiet = subprocess.Popen([sys.executable, "-c", "print('warning only')"])
    quiet.wait(30)
    common._worker_logs[quiet.pid] = tmp_path / "quiet.log"
    (tmp_path / "quiet.log").write_text("[...: WARNING/MainProcess] slow\n")
    common.check_workers(quiet)  # a warning is not a failed job
