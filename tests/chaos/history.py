"""The history a chaos run leaves, and the checker that reads only it.

Three sources, all in the test database:

- ``chaos_publish``: one row per job the workload published (or committed through the
  outbox), written by the workload *before* or *with* the publish;
- ``chaos_effect``: one row per time a job's effect was applied, written *inside* the
  effect (in its transaction), with the pid that applied it;
- the project's own tables: attempts, dead letters, fences.

``check(run)`` counts, from those rows only: jobs, lost (published, with no effect and
no dead letter), duplicates (effect rows beyond the first per job), dead-lettered.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import connection

_TABLES = """
CREATE TABLE IF NOT EXISTS chaos_publish (
    run text NOT NULL, job integer NOT NULL, published_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run, job)
);
CREATE TABLE IF NOT EXISTS chaos_effect (
    id bigserial PRIMARY KEY, run text NOT NULL, job integer NOT NULL, pid integer NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS chaos_effect_run ON chaos_effect (run, job);
"""


def ensure_tables() -> None:
    with connection.cursor() as cursor:
        cursor.execute(_TABLES)


def record_published(run: str, jobs: range | list[int]) -> None:
    """The workload says what it published (before publishing: a job that fails to
    publish is then *lost*, which is what the checker must see)."""
    with connection.cursor() as cursor:
        cursor.executemany(
            "INSERT INTO chaos_publish (run, job) VALUES (%s, %s) ON CONFLICT DO NOTHING",
            [(run, job) for job in jobs],
        )


def record_effect(run: str, job: int, pid: int) -> None:
    """Called inside the effect's transaction by the workload's task."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO chaos_effect (run, job, pid) VALUES (%s, %s, %s)", [run, job, pid]
        )


@dataclass(frozen=True)
class Counts:
    jobs: int
    done: int
    lost: int
    duplicates: int
    dead_lettered: int


def check(run: str, *, key_prefix: str = "chaos") -> Counts:
    """Lost and duplicated effects of ``run``, from the history alone.

    A job is done when it has an effect row, dead-lettered when an open dead letter
    holds its key (``<key_prefix>:<run>:<job>``), lost when neither.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH effects AS (
                SELECT job, count(*) AS n FROM chaos_effect WHERE run = %(run)s GROUP BY job
            ), letters AS (
                SELECT DISTINCT split_part(idempotency_key, ':', 3)::int AS job
                FROM django_outbox_dead_letter
                WHERE idempotency_key LIKE %(like)s
                  -- a malformed message's key may hold anything there (unexpected bodies)
                  AND split_part(idempotency_key, ':', 3) ~ '^[0-9]+$'
            )
            SELECT
                count(*),
                count(*) FILTER (WHERE e.n IS NOT NULL),
                count(*) FILTER (WHERE e.n IS NULL AND l.job IS NULL),
                coalesce(sum(e.n - 1) FILTER (WHERE e.n > 1), 0),
                count(*) FILTER (WHERE e.n IS NULL AND l.job IS NOT NULL)
            FROM chaos_publish p
            LEFT JOIN effects e ON e.job = p.job
            LEFT JOIN letters l ON l.job = p.job
            WHERE p.run = %(run)s
            """,
            {"run": run, "like": f"{key_prefix}:{run}:%"},
        )
        jobs, done, lost, duplicates, dead = cursor.fetchone()
    return Counts(
        jobs=int(jobs),
        done=int(done),
        lost=int(lost),
        duplicates=int(duplicates),
        dead_lettered=int(dead),
    )


def done_count(run: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(DISTINCT job) FROM chaos_effect WHERE run = %s", [run])
        return int(cursor.fetchone()[0])


def duplicate_detail(run: str, *, key_prefix: str = "chaos") -> list[dict[str, object]]:
    """For a failing scenario's message: each job applied more than once, with every
    effect row and the attempts its key recorded (what explain would read)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT e.job, array_agg(e.pid ORDER BY e.id),
                array_agg(e.applied_at::text ORDER BY e.id)
            FROM chaos_effect e WHERE e.run = %s GROUP BY e.job HAVING count(*) > 1
            """,
            [run],
        )
        dups = cursor.fetchall()
        out: list[dict[str, object]] = []
        for job, pids, times in dups[:5]:
            cursor.execute(
                "SELECT task_id, attempt, redelivered, worker_pid, outcome, started_at::text "
                "FROM django_outbox_attempt WHERE idempotency_key = %s ORDER BY started_at",
                [f"{key_prefix}:{run}:{job}"],
            )
            out.append({"job": job, "pids": pids, "at": times, "attempts": cursor.fetchall()})
        return out


def lost_jobs(run: str) -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT p.job FROM chaos_publish p WHERE p.run = %s AND NOT EXISTS "
            "(SELECT 1 FROM chaos_effect e WHERE e.run = p.run AND e.job = p.job) ORDER BY 1",
            [run],
        )
        return [int(r[0]) for r in cursor.fetchall()]
