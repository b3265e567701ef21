"""The execution lease's two calls a job, through a pooled client and a kept connection.

A prefork pool child's Redis client keeps one connection (``redis_state.OneConnection``,
checked with one ``poll`` before each command) instead of taking one from redis-py's
pool on every call. This measures what that saves: CPU µs (``time.process_time``) per
acquire + release of an execution lease, the two clients interleaved in chunks, several
rounds, against the Redis at 127.0.0.1:6379 (db 14). Steadier than ``cpu_per_job.py``,
where the same saving is a few per cent of a job.

    scripts/bench redis_client.py [--jobs 5000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

URL = "redis://127.0.0.1:6379/14"
CHUNK = 250


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=7)
    options = parser.parse_args()
    import django
    from django.conf import settings

    settings.configure(
        EXPLICIT_REDIS_URL=URL, EXPLICIT_KEY_PREFIX=f"bench-rc:{uuid.uuid4().hex[:6]}:"
    )
    django.setup()
    from celery_explicit import execution_lease
    from celery_explicit.redis_state import new_client

    clients: dict[str, Any] = {
        "pooled": new_client(URL, keep_one=False),
        "kept": new_client(URL, keep_one=True),
    }

    def cycle(client: Any, job: str) -> None:
        taken = execution_lease.acquire(job, ttl=30, client=client)
        assert isinstance(taken, execution_lease.Taken), taken
        assert execution_lease.release(job, taken.fence, client=client)

    for name, client in clients.items():  # warm-up: connections, the script library
        for i in range(200):
            cycle(client, f"warm-{name}-{i}")
    rounds = []
    for r in range(options.rounds):
        spent = dict.fromkeys(clients, 0.0)
        for chunk in range(options.jobs // CHUNK):
            for name, client in clients.items():
                start = time.process_time()
                for i in range(CHUNK):
                    cycle(client, f"job-{r}-{chunk}-{i}")
                spent[name] += time.process_time() - start
        rounds.append({name: spent[name] / options.jobs * 1e6 for name in clients})
    size = f"{options.jobs} jobs x {options.rounds} rounds"
    print(f"execution lease acquire + release, CPU µs a job, {size}")
    for name in clients:
        values = [r[name] for r in rounds]
        print(f"  {name:<7} median {statistics.median(values):6.1f}  rounds {_fmt(values)}")
    saved = [r["pooled"] - r["kept"] for r in rounds]
    print(f"  saved   median {statistics.median(saved):6.1f}  rounds {_fmt(saved)}")


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


if __name__ == "__main__":
    main()
