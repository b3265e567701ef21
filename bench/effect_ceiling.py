"""The ceiling of effect_cost.py: the ledger's statements with no Python around them,
raw libpq on one connection, against the same transaction without a ledger row.

The same one-row update in a transaction, without and with a ledger row, sent the way
``effect()`` sends them (BEGIN + claim in one string, the update, the last writes +
COMMIT in one string), so each variant costs the same three round trips as the bare
transaction. What separates them is only PostgreSQL's work for the ledger row. A ratio
here is the ceiling for effect_cost.py's ratios on the machine it runs on: Django's and
our Python can only lower it.

    scripts/bench effect_ceiling.py [--ops 3000] [--rounds 5]
    make bench-p2-ceiling
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable

from common import raw_connection, setup_django


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    setup_django()

    import psycopg

    from bench.benchapp.models import Row
    from django_outbox.db import ledger_sql
    from django_outbox.models import ProcessedOperation

    raw = raw_connection()
    pg = raw.pgconn
    quote = psycopg.ClientCursor(raw).mogrify
    row_table = Row._meta.db_table
    table = ProcessedOperation._meta.db_table

    def run(query: str) -> psycopg.pq.abc.PGresult:
        result = pg.exec_(query.encode())
        if result.status not in (psycopg.pq.ExecStatus.COMMAND_OK, psycopg.pq.ExecStatus.TUPLES_OK):
            raise RuntimeError(result.error_message.decode())
        return result

    def update(i: int) -> str:
        return f"UPDATE {row_table} SET value = value + 1 WHERE id = {i % 100}"

    def claim(sql: str, key: str) -> str:
        params = [key, "bench", key, "f", "2026-11-30T00:00:00Z", "bench"]
        if sql is CLAIM_OR_READ:
            params.append(key)
        return quote(sql, params)

    def bare(keys: list[str]) -> None:
        for i, _ in enumerate(keys):
            run("BEGIN")
            run(update(i))
            run("COMMIT")

    def with_claim(sql: str, result_ref: str | None) -> Callable[[list[str]], None]:
        """``result_ref``: None, or the statement that stores it."""

        def loop(keys: list[str]) -> None:
            for i, key in enumerate(keys):
                run("BEGIN; " + claim(sql, key))
                run(update(i))
                last = ""
                if result_ref is not None:
                    last = quote(result_ref, [key, key]) + "; "
                run(last + "COMMIT")

        return loop

    # The earlier claim: claim, or read the row already there, in one statement. Kept
    # here to show what planning it cost.
    CLAIM_OR_READ = (
        f"WITH claim AS ({ledger_sql.CLAIM}) SELECT true, NULL, NULL FROM claim "
        f"UNION ALL SELECT false, fingerprint, result_ref FROM {table} "
        "WHERE key = %s AND NOT EXISTS (SELECT 1 FROM claim)"
    )
    variants: dict[str, Callable[[list[str]], None]] = {
        "bare: BEGIN, update, COMMIT": bare,
        "ledger, claim or read (CTE, before)": with_claim(CLAIM_OR_READ, ledger_sql.RESULT),
        "ledger, as shipped (result_ref set)": with_claim(ledger_sql.CLAIM, ledger_sql.RESULT),
        "ledger, result_ref left empty": with_claim(ledger_sql.CLAIM, None),
    }
    for loop in variants.values():  # warm-up
        loop([f"warm-{uuid.uuid4().hex}" for _ in range(200)])
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        # A different variant goes first each round: the ledger table grows as they run.
        for name in names[r % len(names) :] + names[: r % len(names)]:
            loop = variants[name]
            keys = [f"c-{uuid.uuid4().hex}" for _ in range(args.ops)]
            start = time.perf_counter()
            loop(keys)
            times[name].append((time.perf_counter() - start) / args.ops * 1e6)
    base = statistics.median(times["bare: BEGIN, update, COMMIT"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<38} median {median:7.1f} us   ratio to bare {base / median:.3f}")


if __name__ == "__main__":
    main()
