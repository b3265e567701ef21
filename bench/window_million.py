"""The window report (``manage.py explicit_explain --since ... --until ...``) on a million attempt
rows: how long one report takes.

Uses ``explain_million.py``'s database and its fill (``--jobs`` jobs of three attempts,
one job a second back from now: two retries then applied; every 50th job dead-lettered,
all of them now), filled once. Times ``window.report`` for windows of several lengths,
``--repeat`` times each, and prints the median and the worst, with what each found.

    scripts/bench window_million.py [--jobs 340000] [--repeat 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

os.environ.setdefault("EXPLICIT_BENCH_DB", "explicit_bench_explain")

from common import setup_django
from explain_million import fill


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=340_000)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    setup_django()

    from django.utils import timezone

    from django_outbox.incident import window
    from django_outbox.models import Attempt

    fill(args.jobs)
    print(f"{Attempt.objects.count()} attempt rows")
    now = timezone.now()
    windows = {
        "30 min, ending now": (now - timedelta(minutes=30), now),
        "30 min, a day ago": (now - timedelta(days=1, minutes=30), now - timedelta(days=1)),
        "6 h, ending now": (now - timedelta(hours=6), now),
        "24 h, ending now": (now - timedelta(hours=24), now),
    }
    for label, (since, until) in windows.items():
        times = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            report = window.report(since, until)
            times.append((time.perf_counter() - started) * 1000)
        events = sum(g.events for g in report.groups)
        print(
            f"window {label:<20} median {statistics.median(times):8.1f} ms   "
            f"worst {max(times):8.1f} ms   ({report.jobs} jobs, {events} events, "
            f"{len(report.groups)} groups)"
        )


if __name__ == "__main__":
    main()
