"""The effect's transaction as the ledger sends it (SQL text, values as literals) against
the same statements prepared once and run through libpq's pipeline mode (values as
parameters): what the protocol itself costs the client and PostgreSQL.

One transaction per operation on one raw libpq connection, three round trips either
way, as an ExplicitTask's job sends them: BEGIN with the ledger's claim and the read of
the stored row; the handler's one-row update (text on both sides); the attempt row
(its 23 columns, from ``records.attempt_fields``), the fence check and COMMIT. The text
side writes the values with the ledger's own ``_literals`` and waits on the socket as
``django_outbox.db.libpq`` does; the prepared side turns each value into its text form
for a parameter. Measured in chunks of 100 transactions, the order reversed every
other chunk: the wall time, this process's CPU and the PostgreSQL backend's CPU (from
/proc) a transaction.

    scripts/bench effect_protocol.py [--ops 1000] [--rounds 5]

Not the product's path: prepared statements are named per connection, which a
transaction-mode pooler (PgBouncer before 1.21) does not keep, so the ledger sends text.
docs/performance.md (A job's floor) gives the figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import select
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from common import raw_connection, setup_django

CHUNK = 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    setup_django()

    from psycopg import pq

    from bench.benchapp.models import Row
    from celery_explicit.outcomes import Outcome
    from celery_explicit.records import attempt_fields
    from django_outbox.db import attempts_sql, ledger_sql
    from django_outbox.store.ledger import _literals

    pg = raw_connection().pgconn
    escape = pq.Escaping(pg).escape_literal
    ok = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)
    update_sql = f"UPDATE {Row._meta.db_table} SET value = value + 1 WHERE id = %d"
    stat_path = f"/proc/{pg.backend_pid}/stat"

    def backend_cpu() -> float:
        with open(stat_path) as stat:
            parts = stat.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")

    def attempt_row(key: str, task_id: str) -> dict[str, Any]:
        now = dt.datetime.now(dt.UTC)
        fields = attempt_fields(
            task_id=task_id,
            task_name="bench.explicit_update",
            idempotency_key=key,
            attempt=1,
            redelivered=False,
            worker_host="celery@bench",
            worker_pid=os.getpid(),
            started_at=now,
            finished_at=now,
            outcome=Outcome.SUCCEEDED,
            correlation_id=uuid.uuid4().hex,
            published_via="direct",
            sent_at=now,
            version="",
        )
        fields["outcome"] = Outcome.SUCCEEDED.value
        return fields

    columns = list(attempt_row("", ""))
    insert = attempts_sql.INSERT.format(
        columns=", ".join(columns), placeholders=", ".join(["%s"] * len(columns))
    )

    def next_result() -> Any:
        # As django_outbox.db.libpq: wait on the socket, not in libpq.
        while pg.is_busy():
            select.select([pg.socket], [], [])
            pg.consume_input()
        result = pg.get_result()
        if result is not None and result.status not in (*ok, pq.ExecStatus.PIPELINE_SYNC):
            raise RuntimeError(result.error_message.decode())
        return result

    def wait_all() -> None:
        while next_result() is not None:
            pass

    def text(sql: str, values: Sequence[Any]) -> str:
        literals = _literals(values, escape)
        assert literals is not None, values
        return sql % literals

    def run_text(query: str) -> None:
        pg.send_query(query.encode())
        wait_all()

    def as_text(i: int) -> None:
        key, task_id = f"p-{uuid.uuid4().hex}", uuid.uuid4().hex
        claim = [key, "bench.explicit_update", task_id, "f" * 64, dt.datetime.now(dt.UTC), ""]
        run_text(f"BEGIN; {text(ledger_sql.CLAIM, claim)}; {text(ledger_sql.EXISTING, [key])}")
        run_text(update_sql % (i % 100))
        run_text(
            f"{text(insert, list(attempt_row(key, task_id).values()))}; "
            f"{text(ledger_sql.FENCE_CHECK, [task_id, 1])}; COMMIT"
        )

    statements = {
        b"claim": ledger_sql.CLAIM,
        b"existing": ledger_sql.EXISTING,
        b"attempt": insert,
        b"fence": ledger_sql.FENCE_CHECK,
    }
    for name, sql in statements.items():
        prepared = pg.prepare(name, _numbered(sql))
        assert prepared.status == pq.ExecStatus.COMMAND_OK, prepared.error_message

    def pipeline(sends: list[Callable[[], None]]) -> None:
        pg.enter_pipeline_mode()
        try:
            for send in sends:
                send()
            pg.pipeline_sync()
            while True:
                result = next_result()  # None: the end of one statement's results
                if result is not None and result.status == pq.ExecStatus.PIPELINE_SYNC:
                    return
        finally:
            pg.exit_pipeline_mode()

    def as_prepared(i: int) -> None:
        key, task_id = f"p-{uuid.uuid4().hex}", uuid.uuid4().hex
        claim = _params(
            [key, "bench.explicit_update", task_id, "f" * 64, dt.datetime.now(dt.UTC), ""]
        )
        pipeline(
            [
                lambda: pg.send_query_params(b"BEGIN", None),
                lambda: pg.send_query_prepared(b"claim", claim),
                lambda: pg.send_query_prepared(b"existing", claim[:1]),
            ]
        )
        run_text(update_sql % (i % 100))
        row, fence = _params(list(attempt_row(key, task_id).values())), _params([task_id, 1])
        pipeline(
            [
                lambda: pg.send_query_prepared(b"attempt", row),
                lambda: pg.send_query_prepared(b"fence", fence),
                lambda: pg.send_query_params(b"COMMIT", None),
            ]
        )

    sides: dict[str, Callable[[int], None]] = {"text": as_text, "prepared": as_prepared}
    for side in sides.values():  # warm-up
        for i in range(300):
            side(i)
    figures: dict[str, dict[str, list[float]]] = {
        name: {"wall": [], "cpu": [], "postgres": []} for name in sides
    }
    for _ in range(options.rounds):
        spent = {name: [0.0, 0.0, 0.0] for name in sides}
        for chunk in range(options.ops // CHUNK):
            for name in list(sides) if chunk % 2 == 0 else list(reversed(sides)):
                wall, cpu, server = time.perf_counter(), time.process_time(), backend_cpu()
                for i in range(CHUNK):
                    sides[name](i)
                spent[name][0] += time.perf_counter() - wall
                spent[name][1] += time.process_time() - cpu
                spent[name][2] += backend_cpu() - server
        for name in sides:
            for part, total in zip(("wall", "cpu", "postgres"), spent[name], strict=True):
                figures[name][part].append(total / options.ops * 1e6)

    print(f"the effect's transaction, µs each, {options.ops} x {options.rounds} rounds")
    for name in sides:
        print(
            f"  {name:<9}"
            + "".join(
                f"  {part} {statistics.median(values):5.0f} ({_fmt(values)})"
                for part, values in figures[name].items()
            )
        )
    ratios = [
        t / p for t, p in zip(figures["text"]["wall"], figures["prepared"]["wall"], strict=True)
    ]
    print(
        f"transactions/s, prepared / text, per round: {_fmt(ratios, 3)}"
        f" -> median {statistics.median(ratios):.3f}"
    )


def _numbered(sql: str) -> bytes:
    """``%s`` placeholders as PostgreSQL's ``$1``, ``$2``, ..."""
    head, *rest = sql.split("%s")
    return (head + "".join(f"${n}{part}" for n, part in enumerate(rest, 1))).encode()


def _params(values: Sequence[Any]) -> list[bytes | None]:
    """Each value in its text form, as a parameter (one loop, as ``_literals``)."""
    out: list[bytes | None] = []
    append = out.append
    for value in values:
        kind = type(value)
        if value is None:
            append(None)
        elif kind is str:
            append(value.encode())
        elif kind is bool:
            append(b"t" if value else b"f")
        elif kind is dt.datetime:
            append(value.isoformat().encode())
        else:
            append(str(value).encode())
    return out


def _fmt(values: Sequence[float], digits: int = 0) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values)


if __name__ == "__main__":
    main()
