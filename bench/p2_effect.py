"""P2: ``effect()`` vs a bare ``transaction.atomic()`` doing the same one-row update.

Interleaved blocks in one process on PostgreSQL. Targets: effect/atomic >= 0.93; a
duplicate hit (key already in the ledger) costs <= 0.5 of a first run.

    .venv/bin/python bench/p2_effect.py [--ops 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time
import uuid

from common import reset_rows, setup_django, summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    setup_django()

    from django.db import transaction
    from django.db.models import F

    from bench.benchapp.models import Row
    from django_outbox import ledger

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

    bare_rates, effect_rates, dup_rates, hand_rates, goc_rates = [], [], [], [], []
    for _ in range(args.rounds):
        keys = [f"p2-{uuid.uuid4().hex}" for _ in range(args.ops)]
        bare_rates.append(bare(keys))
        effect_rates.append(with_effect(keys))
        dup_rates.append(with_effect(keys))  # every key is now in the ledger
        hand_rates.append(by_hand([f"h-{key}" for key in keys]))
        goc_rates.append(get_or_create([f"g-{key}" for key in keys]))

    print(summary("bare transaction.atomic() update", bare_rates))
    print(summary("effect() first run", effect_rates))
    print(summary("effect() duplicate hit", dup_rates))
    print(summary("effect()'s statements by hand", hand_rates))
    hand = sorted(e / h for e, h in zip(effect_rates, hand_rates, strict=True))
    print(
        f"P2a effect/by hand per round: {', '.join(f'{r:.3f}' for r in hand)}"
        f"  -> median {hand[len(hand) // 2]:.3f} (target >= 0.97)"
    )
    print(summary("get_or_create of a processed key", goc_rates))
    goc = sorted(e / g for e, g in zip(effect_rates, goc_rates, strict=True))
    print(
        f"P2b effect/get_or_create per round: {', '.join(f'{r:.3f}' for r in goc)}"
        f"  -> median {goc[len(goc) // 2]:.3f} (target >= 2.0)"
    )
    ratios = sorted(e / b for e, b in zip(effect_rates, bare_rates, strict=True))
    dup_cost = sorted(e / d for e, d in zip(effect_rates, dup_rates, strict=True))
    print(
        f"P2 ratio effect/atomic per round: {', '.join(f'{r:.3f}' for r in ratios)}"
        f"  -> median {ratios[len(ratios) // 2]:.3f} (target >= 0.93)"
    )
    print(
        f"duplicate-hit cost / first-run cost per round: "
        f"{', '.join(f'{r:.3f}' for r in dup_cost)}"
        f"  -> median {dup_cost[len(dup_cost) // 2]:.3f} (P2c target <= 0.40)"
    )


if __name__ == "__main__":
    main()
