"""The cost of ``effect()`` (operations/s) against a bare ``transaction.atomic()`` doing
the same one-row update, and against what people write by hand.

Interleaved blocks in one process on PostgreSQL. The targets (P2 in
docs/performance.md): P2a, effect() / its own statements by hand through Django's
cursor >= 0.97; P2b, effect() / ``get_or_create`` of a processed-key row >= 2.0; P2c, a
duplicate hit (key already in the ledger) / a first run <= 0.40. Also printed: P2b's
ceiling, effect()'s statements in its three round trips with none of our Python, over
``get_or_create``; and effect/atomic.

    scripts/bench effect_cost.py [--ops 2000] [--rounds 5]
    make bench-p2
"""

from __future__ import annotations

import argparse
import time
import uuid

from common import ratio_line, reset_rows, setup_django, summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    setup_django()

    from django.db import transaction
    from django.db.models import F

    from bench.benchapp.models import Row
    from django_outbox.store import ledger

    reset_rows()

    def bare(keys: list[str]) -> float:
        start = time.perf_counter()
        for i, _ in enumerate(keys):
            with transaction.atomic():
                Row.objects.filter(id=i % 100).update(value=F("value") + 1)
        return len(keys) / (time.perf_counter() - start)

    def with_effect(keys: list[str]) -> float:
        start = time.perf_counter()
        for i, key in enumerate(keys):
            with ledger.effect(key=key, fingerprint="f", task_name="bench", task_id=key) as eff:
                if eff.done:
                    continue
                Row.objects.filter(id=i % 100).update(value=F("value") + 1)
                eff.result_ref = key
        return len(keys) / (time.perf_counter() - start)

    from django.db import connection

    table = "django_outbox_processed_operation"
    claim_sql = (
        f"INSERT INTO {table} (key, task_name, task_id, fingerprint, result_ref, "
        "processed_at) VALUES (%s, 'bench', %s, 'f', '', now()) "
        "ON CONFLICT (key) DO NOTHING RETURNING key"
    )
    result_sql = f"UPDATE {table} SET result_ref = %s WHERE key = %s"

    def by_hand(keys: list[str]) -> float:
        """P2a's reference: effect()'s own statements (claim, the update, result_ref),
        sent through Django's cursor inside atomic(), none of our code."""
        start = time.perf_counter()
        for i, key in enumerate(keys):
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(claim_sql, [key, key])
                if cursor.fetchone() is None:
                    continue
                Row.objects.filter(id=i % 100).update(value=F("value") + 1)
                cursor.execute(result_sql, [key, key])
        return len(keys) / (time.perf_counter() - start)

    def fewest_round_trips(keys: list[str]) -> float:
        """P2b's ceiling: effect()'s statements in its three round trips (BEGIN + the
        claim; the update; the result + COMMIT), built with f-strings and sent on
        libpq's connection: effect() with none of our Python. The keys are the bench's
        own hex, which need no escaping."""
        connection.ensure_connection()
        pgconn = connection.connection.pgconn
        start = time.perf_counter()
        for i, key in enumerate(keys):
            with transaction.atomic():
                claimed = pgconn.exec_(
                    f"BEGIN; INSERT INTO {table} (key, task_name, task_id, fingerprint, "
                    f"result_ref, processed_at) VALUES ('{key}', 'bench', '{key}', 'f', '', "
                    "now()) ON CONFLICT (key) DO NOTHING RETURNING key".encode()
                )
                if claimed.ntuples != 1:
                    raise RuntimeError(f"{key}: the claim lost ({claimed.error_message!r})")
                Row.objects.filter(id=i % 100).update(value=F("value") + 1)
                done = pgconn.exec_(
                    f"UPDATE {table} SET result_ref = '{key}' WHERE key = '{key}'; COMMIT".encode()
                )
                if done.command_status != b"COMMIT":
                    raise RuntimeError(f"{key}: no COMMIT ({done.error_message!r})")
        return len(keys) / (time.perf_counter() - start)

    from bench.benchapp.models import ProcessedKey, ensure_processed_table

    ensure_processed_table()

    def get_or_create(keys: list[str]) -> float:
        """P2b's reference: what people write by hand, a processed-key row through
        get_or_create in the effect's transaction."""
        start = time.perf_counter()
        for i, key in enumerate(keys):
            with transaction.atomic():
                _, created = ProcessedKey.objects.get_or_create(key=key)
                if created:
                    Row.objects.filter(id=i % 100).update(value=F("value") + 1)
        return len(keys) / (time.perf_counter() - start)

    # Warm-up: connection, statement paths.
    bare([str(i) for i in range(200)])
    with_effect([f"warm-{i}" for i in range(200)])
    by_hand([f"warm-hand-{i}" for i in range(200)])
    get_or_create([f"warm-goc-{i}" for i in range(200)])
    fewest_round_trips([f"warm-raw-{i}" for i in range(200)])

    bare_rates, effect_rates, dup_rates, hand_rates, goc_rates = [], [], [], [], []
    raw_rates: list[float] = []
    for _ in range(args.rounds):
        keys = [f"p2-{uuid.uuid4().hex}" for _ in range(args.ops)]
        bare_rates.append(bare(keys))
        effect_rates.append(with_effect(keys))
        dup_rates.append(with_effect(keys))  # every key is now in the ledger
        hand_rates.append(by_hand([f"h-{key}" for key in keys]))
        goc_rates.append(get_or_create([f"g-{key}" for key in keys]))
        raw_rates.append(fewest_round_trips([f"r-{key}" for key in keys]))

    print(summary("bare transaction.atomic() update", bare_rates))
    print(summary("effect() first run", effect_rates))
    print(summary("effect() duplicate hit", dup_rates))
    print(summary("effect()'s statements by hand", hand_rates))
    hand = [e / h for e, h in zip(effect_rates, hand_rates, strict=True)]
    print(ratio_line("P2a effect/by hand", hand, "target >= 0.97"))
    print(summary("get_or_create of a processed key", goc_rates))
    goc = [e / g for e, g in zip(effect_rates, goc_rates, strict=True)]
    print(ratio_line("P2b effect/get_or_create", goc, "target >= 2.0"))
    print(summary("effect()'s statements, raw", raw_rates))
    ceiling = [r / g for r, g in zip(raw_rates, goc_rates, strict=True)]
    print(
        ratio_line(
            "P2b's ceiling, the same statements raw / get_or_create",
            ceiling,
            "what effect() would read with none of our Python",
        )
    )
    ratios = [e / b for e, b in zip(effect_rates, bare_rates, strict=True)]
    dup_cost = [e / d for e, d in zip(effect_rates, dup_rates, strict=True)]
    print(ratio_line("P2 ratio effect/atomic", ratios, "target >= 0.93"))
    print(ratio_line("duplicate-hit cost / first-run cost", dup_cost, "P2c target <= 0.40"))


if __name__ == "__main__":
    main()
