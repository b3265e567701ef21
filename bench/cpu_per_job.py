"""CPU time this process spends per job (the GIL held), ExplicitTask minus a plain task.

Each job runs through Celery's tracer in this process (``task.apply()``: the request,
the tracer, our pipeline, the handler), against the real PostgreSQL and Redis. What
is counted is ``time.process_time()``: CPU this process used, not time waiting for the
servers, so load elsewhere on the machine moves it far less than a throughput. Three
tasks doing the same row update, interleaved in chunks of CHUNK jobs, several rounds:

- plain: ``bench.plain_update``, an acks_late task, one ``UPDATE`` in ``atomic()``;
- floor: ``bench.floor_update``, the statements the contract needs, sent by hand;
- explicit: ``bench.explicit_update``, an ExplicitTask (lease, effect, ledger, attempt).

Target (P1c in docs/performance.md): explicit minus plain <= 500 µs per job.

    scripts/bench cpu_per_job.py [--jobs 2000] [--rounds 5] [--profile FILE]

``--profile FILE`` writes a cProfile of the explicit jobs of one extra round (pstats).

This process stands for a prefork pool child: it sends ``worker_process_init`` as
billiard's child does, so our Redis client keeps its one connection there
(``celery_explicit.redis_state``); ``EXPLICIT_BENCH_POOL_CHILD=0`` leaves it out (the
pooled client everywhere: the A/B of docs/performance.md). It also runs Celery's
``setup_worker_optimizations``, as the worker's main process does before it forks (its
children inherit it): with it, ``Task.__call__`` inside a traced job calls ``run()``
without pushing a second request. An ExplicitTask's handler goes through that call,
so without it this process would count a push and a pop no worker makes.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import pool_child_jobs, setup_django

CHUNK = 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", default="")
    options = parser.parse_args()
    setup_django()
    sides = pool_child_jobs("bench@p1c")
    for fn in sides.values():  # warm-up: connections, scripts loaded, imports
        for i in range(200):
            fn(i)

    rounds: list[dict[str, float]] = []
    for _ in range(options.rounds):
        spent = dict.fromkeys(sides, 0.0)
        for chunk in range(options.jobs // CHUNK):
            for name, fn in sides.items():
                start = time.process_time()
                for i in range(chunk * CHUNK, (chunk + 1) * CHUNK):
                    fn(i)
                spent[name] += time.process_time() - start
        rounds.append({name: spent[name] / options.jobs * 1e6 for name in sides})

    print(f"P1c: CPU µs per job in this process, {options.jobs} jobs x {options.rounds} rounds")
    for name in sides:
        values = [r[name] for r in rounds]
        print(f"  {name:<9} median {statistics.median(values):7.0f} µs   rounds {_fmt(values)}")
    over_plain = [r["explicit"] - r["plain"] for r in rounds]
    floor_over = [r["floor"] - r["plain"] for r in rounds]
    print(f"  explicit - plain  median {statistics.median(over_plain):5.0f} µs  {_fmt(over_plain)}")
    print(f"  floor - plain     median {statistics.median(floor_over):5.0f} µs  {_fmt(floor_over)}")
    print("target: explicit - plain <= 500 µs")

    if options.profile:
        import cProfile

        profiler = cProfile.Profile(time.process_time)  # CPU, not time waiting
        profiler.enable()
        for i in range(options.jobs):
            sides["explicit"](i)
        profiler.disable()
        profiler.dump_stats(options.profile)
        print(f"profile of {options.jobs} explicit jobs: {options.profile}")


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.0f}" for v in values)


if __name__ == "__main__":
    main()
