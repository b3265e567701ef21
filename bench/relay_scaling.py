"""Several outbox relays side by side: events per second with 1, 2 and 4 relay processes,
with the order per key and the once-only publish checked on what reached the broker.

Each round starts K ``manage.py explicit_relay`` processes (LISTENing, as deployed) on an
empty table, then commits a backlog of N events in one transaction, with the NOTIFY a
writer sends (``--poll-interval 0.02`` instead: relays that poll): events with an
ordering key (``--keys`` of them, numbered within their key) and, one in
``--unkeyed-every``, events without one. Rate = N / (commit -> the last message in
the Redis queue). Then every message in the queue is read back: an event published
twice (by two relays, or twice by one) or a key whose numbers arrive out of order
fails the run. Relay counts are interleaved within each round, so every count sees
the same machine.

The claim (``FOR UPDATE SKIP LOCKED``, one event per key per batch) is what lets
relays share a table; a key's next event is claimable only after the previous one's
publish committed, so many events on few keys scale less than many keys.

    scripts/bench relay_scaling.py [--events 20000] [--keys 500] [--rounds 3]
                                   [--relays 1,2,4] [--batch-size 500]
                                   [--unkeyed-every 4] [--claims new,walk]

``--claims new,walk`` runs every relay count with each claim in turn, in the same
rounds: ``new`` is the package's claim, ``walk`` the claim it replaced (kept below,
``WALK_CLAIM``), whose relays run as ``relay_scaling.py --relay walk``: the relay
command claiming with that statement alone, as it ran before.

Everything shares one machine's cores (2 here): relays, PostgreSQL and Redis.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections import defaultdict

from common import DB_NAME, ROOT, setup_django, vacuum

# The claim before heads were found by key: every pending event in id order, each with
# the head-of-key test, until LIMIT are found. Behind heads another relay holds, it
# reads every pending event of the backlog.
WALK_CLAIM = """
WITH claimed AS MATERIALIZED (
    SELECT event.id
    FROM django_outbox_event AS event
    WHERE event.status = 'pending'
      AND event.available_at <= now()
      AND (event.ordering_key = '' OR NOT EXISTS (
            SELECT 1 FROM django_outbox_event AS earlier
            WHERE earlier.ordering_key = event.ordering_key
              AND earlier.status = 'pending'
              AND earlier.id < event.id))
    ORDER BY event.id
    LIMIT %(limit)s
    FOR UPDATE OF event SKIP LOCKED
)
SELECT event.id, event.event_id::text, event.task_name, event.args, event.kwargs,
       event.headers, event.options, event.ordering_key, event.attempts,
       extract(epoch FROM event.created_at)::float8
FROM django_outbox_event AS event
WHERE event.id = ANY(ARRAY(SELECT id FROM claimed))
ORDER BY event.id
"""

CLAIMS = ("new", "walk")


def relay(claim: str, argv: list[str]) -> None:
    """``manage.py explicit_relay`` with ``argv``, claiming with ``claim``."""
    import django

    django.setup()
    from django.core.management import call_command

    from django_outbox.db import relay_sql
    from django_outbox.outbox.relay import claim as package_claim

    if claim == "walk":
        # The relay claims through claim_batch(): the walk alone, as it ran before, with
        # the server's planner settings (run_claim() sends SORT_OFF before a claim).
        relay_sql.SORT_OFF = relay_sql.SORT_DEFAULT
        package_claim.claim_batch = lambda using, limit: package_claim.run_claim(
            using, WALK_CLAIM, limit
        )
    call_command("explicit_relay", *argv)


def main() -> None:
    if sys.argv[1:2] == ["--relay"]:
        relay(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--keys", type=int, default=500, help="ordering keys in the backlog")
    parser.add_argument(
        "--unkeyed-every", type=int, default=4, help="one event in this many has no key"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--relays", default="1,2,4", help="relay counts to compare")
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument(
        "--poll-interval", type=float, default=None, help="relays poll this often (no NOTIFY)"
    )
    parser.add_argument(
        "--claims", default="new", help="claims to compare: new (the package's), walk (before)"
    )
    args = parser.parse_args()
    counts = [int(c) for c in args.relays.split(",")]
    claims = args.claims.split(",")
    for name in claims:
        if name not in CLAIMS:
            parser.error(f"--claims: {name!r} is none of {', '.join(CLAIMS)}")
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    os.environ["EXPLICIT_BENCH_QUEUE"] = queue
    setup_django()

    import redis
    from django.conf import settings as django_settings
    from django.db import connection, transaction

    from bench.benchapp.tasks import ExplicitUpdate
    from bench.celery_app import app
    from django_outbox.conf import settings as explicit
    from django_outbox.models import OutboxEvent

    task = app.tasks[ExplicitUpdate.name]
    broker = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "EXPLICIT_TEST_DB_NAME": DB_NAME,
        "PYTHONPATH": str(ROOT),
    }

    def start_relays(k: int, claim: str) -> list[subprocess.Popen[str]]:
        relays = []
        polling = ["--poll-interval", str(args.poll_interval)] if args.poll_interval else []
        options = ["--batch-size", str(args.batch_size), *polling]
        if claim == "new":
            command = [sys.executable, "-m", "django", "explicit_relay", *options]
        else:
            command = [sys.executable, __file__, "--relay", claim, *options]
        for _ in range(k):
            relay = subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            atexit.register(relay.kill)  # a failed run must not leave a relay publishing
            assert relay.stdout is not None
            before: list[str] = []
            while "ready" not in (line := relay.stdout.readline()):
                assert line, "".join(before)
                before.append(line)
            relays.append(relay)
        return relays

    def backlog() -> list[OutboxEvent]:
        events = []
        numbers: dict[str, int] = defaultdict(int)
        for i in range(args.events):
            key = None if i % args.unkeyed_every == 0 else f"key-{i % args.keys}"
            seq = numbers[key or ""]
            numbers[key or ""] += 1
            events.append(
                OutboxEvent(
                    task_name=task.name,
                    kwargs={"row_id": i % 100, "op_id": f"{key or '-'}|{seq}|{i}"},
                    headers={"idempotency_key": f"scale:{i}"},
                    ordering_key=key or "",
                )
            )
        return events

    def one_run(k: int, claim: str) -> float:
        OutboxEvent.objects.all().delete()
        vacuum()
        broker.delete(queue)
        relays = start_relays(k, claim)
        try:
            rows = backlog()
            with transaction.atomic():
                OutboxEvent.objects.bulk_create(rows)
                if not args.poll_interval:
                    with connection.cursor() as cursor:  # delivered at commit
                        cursor.execute(f"NOTIFY {explicit.outbox_notify_channel}")
            start = time.perf_counter()
            deadline = start + 600
            while broker.llen(queue) < args.events:
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"{k} relays: {broker.llen(queue)} of {args.events}")
                time.sleep(0.005)
            elapsed = time.perf_counter() - start
        finally:
            for relay in relays:
                relay.terminate()
            for relay in relays:
                relay.wait(30)
        check(k)
        return args.events / elapsed

    def check(k: int) -> None:
        # kombu's Redis transport LPUSHes: the oldest message is at the list's tail.
        raw = broker.lrange(queue, 0, -1)[::-1]
        seen: set[str] = set()
        last: dict[str, int] = {}
        for item in raw:
            envelope = json.loads(item)
            body = json.loads(base64.b64decode(envelope["body"]))
            key, seq, i = body[1]["op_id"].split("|")
            if i in seen:
                raise AssertionError(f"{k} relays: event {i} published twice")
            seen.add(i)
            if key != "-":
                if last.get(key, -1) >= int(seq):
                    raise AssertionError(f"{k} relays: key {key} out of order at {seq}")
                last[key] = int(seq)
        assert len(seen) == args.events, (k, len(seen))

    runs = [(claim, k) for claim in claims for k in counts]
    rates: dict[tuple[str, int], list[float]] = {run: [] for run in runs}
    for round_no in range(args.rounds):
        for claim, k in runs:
            rates[claim, k].append(one_run(k, claim))
        line = ", ".join(f"{claim} {k}: {rates[claim, k][-1]:.0f}/s" for claim, k in runs)
        print(f"round {round_no + 1}: {line} (no event twice, every key in order)", flush=True)
    print(
        f"\n{args.events} events, {args.keys} keys, 1 in {args.unkeyed_every} unkeyed, "
        f"batch {args.batch_size}; x: per round, against the first claim's {counts[0]} relay"
        f"{'s' if counts[0] > 1 else ''}"
    )
    base = rates[claims[0], counts[0]]
    for claim, k in runs:
        ratios = [r / b for r, b in zip(rates[claim, k], base, strict=True)]
        print(
            f"{claim:>5} {k} relay{'s' if k > 1 else ' '}  median "
            f"{statistics.median(rates[claim, k]):8.0f} events/s  "
            f"x{statistics.median(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})  "
            f"(rounds: {', '.join(f'{r:.0f}' for r in rates[claim, k])})"
        )
    broker.delete(queue)


if __name__ == "__main__":
    main()
