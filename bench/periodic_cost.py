"""What publishing each periodic slot once costs a beat: our scheduler's publish of a due
run (the slot claimed in Redis, the message published, the slot recorded as a row)
beside Celery's own ``Scheduler.apply_async`` of the same entry, rounds interleaved in
one run. The cost is the beat's, once per slot; a worker runs the job as any other.

Each of our publishes is for a slot of its own (a minute apart, as a beat meets them),
through ``SlotClaims._publish_once``, the part of ``apply_async`` after beat chose the
slot. Publishes to a queue no worker reads, deleted afterwards; claims and rows of the
bench's own entry name, removed afterwards.

    scripts/bench periodic_cost.py [--slots 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import datetime as dt
import tempfile
import time
import uuid

from common import cost_lines, setup_django, summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slots", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    setup_django()

    import celery.beat
    from celery.schedules import schedule

    from bench.celery_app import app
    from celery_explicit import periodic, redis_state
    from celery_explicit.beat import PersistentScheduler
    from django_outbox.models import PeriodicSlot

    queue = f"bench-beat-{uuid.uuid4().hex[:8]}"
    name = f"bench-entry-{uuid.uuid4().hex[:8]}"
    entry = celery.beat.ScheduleEntry(
        name=name,
        task="bench.explicit_update",
        schedule=schedule(60),
        args=(1, "op"),
        options={"queue": queue},
        app=app,
    )
    theirs = celery.beat.Scheduler(app=app, lazy=True)
    with tempfile.TemporaryDirectory() as folder:
        ours = PersistentScheduler(app=app, schedule_filename=f"{folder}/beat", lazy=True)
        grid = periodic.grid_of(entry.schedule)
        start = grid.slot_at(dt.datetime.now(dt.UTC))
        used = 0

        def plain(n: int) -> float:
            began = time.perf_counter()
            with app.producer_or_acquire() as producer:
                for _ in range(n):
                    theirs.apply_async(entry, producer, advance=False)
            return n / (time.perf_counter() - began)

        def once_per_slot(n: int) -> float:
            nonlocal used
            began = time.perf_counter()
            with app.producer_or_acquire() as producer:
                for i in range(used, used + n):
                    ours._publish_once(entry, producer, start - dt.timedelta(minutes=i), grid)
            used += n
            return n / (time.perf_counter() - began)

        sides = {"Celery's Scheduler": plain, "SlotClaims (ours)": once_per_slot}
        rates: dict[str, list[float]] = {side: [] for side in sides}
        try:
            for side in sides.values():
                side(100)  # warm-up: connections, the scripts loaded
            for r in range(args.rounds):
                order = list(sides.items())
                for side_name, side in order if r % 2 == 0 else reversed(order):
                    rates[side_name].append(side(args.slots))
        finally:
            with app.connection_for_write() as conn:
                conn.default_channel.queue_delete(queue)
            PeriodicSlot.objects.filter(entry=name).delete()
            client = redis_state.client()
            for key in client.scan_iter(f"{redis_state.prefix()}periodic:*{name}*"):
                client.delete(key)
    for side_name, side_rates in rates.items():
        print(summary(f"{side_name} publishes", side_rates))
    base, ours_rates = rates["Celery's Scheduler"], rates["SlotClaims (ours)"]
    print(cost_lines("ours / Celery's", ours_rates, base, "once per slot", per="a slot"))


if __name__ == "__main__":
    main()
