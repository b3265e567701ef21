"""Python opcodes a job runs in this process: a plain task, the floor, an ExplicitTask.

The same three tasks as ``cpu_per_job.py`` (P1c), each run through Celery's tracer in
this process against the real PostgreSQL and Redis, counted by ``sys.settrace`` with
``f_trace_opcodes``: every bytecode instruction Python runs for a job, in Celery, in
Django, in redis-py, in ours. A count, not a time: the machine's speed, which moves a
CPU figure by half between hours here, does not move it, so a change to our Python of
a few µs a job shows as the same number in every run. The time an opcode costs differs
(a call to C counts one), so it ranks where our Python goes; the µs are P1c's.

    scripts/bench opcodes_per_job.py [--jobs 20] [--top 30]

Prints the opcodes a job of each side runs, the ExplicitTask's over the floor's by file,
and the functions of ours that run the most.
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable
from typing import Any

from common import OURS, count_opcodes, pool_child_jobs, setup_django


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--top", type=int, default=30)
    options = parser.parse_args()
    setup_django()
    sides = pool_child_jobs("bench@opcodes")  # as cpu_per_job.py: a prefork pool child
    for fn in sides.values():  # warm-up: connections, scripts loaded, caches filled
        for i in range(100):
            fn(i)

    counted = {name: _jobs_counted(fn, options.jobs) for name, fn in sides.items()}
    print(f"Python opcodes a job, {options.jobs} jobs each")
    for name, by_function in counted.items():
        print(f"  {name:<9} {sum(by_function.values()) / options.jobs:8.0f}")

    def by_file(name: str) -> collections.Counter[str]:
        files: collections.Counter[str] = collections.Counter()
        for (path, _function), n in counted[name].items():
            files[path] += n
        return files

    explicit_files, floor_files = by_file("explicit"), by_file("floor")
    print("the ExplicitTask over the floor, by file (opcodes a job)")
    over = {
        p: (explicit_files[p] - floor_files[p]) / options.jobs for p in explicit_files | floor_files
    }
    for path, n in sorted(over.items(), key=lambda item: -abs(item[1]))[: options.top]:
        print(f"  {n:+7.0f}  {path}")
    ours = {
        key: n / options.jobs for key, n in counted["explicit"].items() if key[0].startswith(OURS)
    }
    print(f"ours in the ExplicitTask's job: {sum(ours.values()):.0f} opcodes a job; the most:")
    for (path, function), n in sorted(ours.items(), key=lambda item: -item[1])[: options.top]:
        print(f"  {n:7.0f}  {path}:{function}")


def _jobs_counted(fn: Callable[[int], Any], jobs: int) -> collections.Counter[tuple[str, str]]:
    def run() -> None:
        for i in range(jobs):
            fn(i)

    return count_opcodes(run)


if __name__ == "__main__":
    main()
