"""What an attempt's log line costs: Celery's text format against the JSON formatter of
the docs' LOGGING snippet, and off (level WARNING: an INFO line is not formatted).

In one process, the line ``records.emit`` writes at an attempt's end (its metric
included, as on the job path), to /dev/null through a StreamHandler; the three set-ups
alternate round by round so load on the machine falls on all of them alike.

    scripts/bench logs_cost.py [--lines 20000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

from common import setup_django

CELERY_FORMAT = "[%(asctime)s: %(levelname)s/%(processName)s] %(message)s"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    setup_django()

    from django.utils import timezone
    from pythonjsonlogger.json import JsonFormatter

    from celery_explicit import job_log, records
    from celery_explicit.execution import Execution
    from celery_explicit.outcomes import Outcome

    sink = open(os.devnull, "w")  # noqa: SIM115 - kept open for the whole run
    handler = logging.StreamHandler(sink)
    logger = logging.getLogger("celery_explicit")
    logger.addHandler(handler)
    logger.propagate = False
    setups = {
        "celery text": (logging.INFO, logging.Formatter(CELERY_FORMAT)),
        "json": (
            logging.INFO,
            JsonFormatter("%(asctime)s %(levelname)s %(name)s %(process)d %(message)s"),
        ),
        "off (WARNING)": (logging.WARNING, logging.Formatter(CELERY_FORMAT)),
    }
    execution = Execution(
        task_id="5b9c6a0e-0000-4000-8000-000000000001",
        task_name="shop.ship_order",
        key="order:1003:ship",
        fingerprint="f",
        attempt=1,
        started_at=timezone.now(),
        correlation_id="c" * 32,
        timings={"queue_wait": 3.2, "execution_lease": 0.4, "handler": 21.0, "commit": 1.1},
    )
    token = job_log.bind(execution.log_fields())
    per_line: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(args.rounds):
        for name, (level, formatter) in setups.items():
            logger.setLevel(level)
            handler.setFormatter(formatter)
            started = time.perf_counter()
            for _ in range(args.lines):
                records.emit(execution, Outcome.APPLIED)
            per_line[name].append((time.perf_counter() - started) / args.lines * 1e6)
    job_log.reset(token)
    print(f"attempt line (records.emit), µs per attempt, {args.rounds} rounds x {args.lines}")
    for name, values in per_line.items():
        print(
            f"  {name:<14} median {statistics.median(values):7.1f}   "
            f"min {min(values):7.1f}   max {max(values):7.1f}"
        )


if __name__ == "__main__":
    main()
