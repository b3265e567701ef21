"""The host partitions' task, and the client the test runs next to the private services.

``chaos.host_job`` runs longer than its lease on the first host that gets it: it says
where it runs (``hosts:started:<run>:<job>``, ``<host>:<pid>``), then waits for the test's
``hosts:proceed`` key while the test cuts that host's link past the lease and restores it.
Any later execution (the host that took the job over) goes straight to the effect.

The effect is guarded by the execution lease's fencing token alone (``fenced_update``
on a row of its own, the effect row in the same transaction), not by the ledger:
``effect()``'s ledger would absorb the stale host's second effect whatever the lease
did (its primary key admits one claim per key), so a run with the lease off could
never show what the lease is for. A refused write is this execution's lost lease
(``LeaseLost``): recorded as ``fenced``, nothing of it committed. With the lease off
there is no token to carry: the write goes through, as any unguarded downstream write
would, and the stale host applies the effect a second time.

``serve()`` (the test runs it in a process of its own, ``CLIENT``) reads commands on
stdin, one JSON answer a line:
``setup`` (create and migrate the database, the history tables), ``publish RUN JOB
GUARD``, ``check RUN`` (the history's counts and every attempt of the run).
"""

from __future__ import annotations

import json
import os
import sys
import time

import redis

from celery_explicit import ExplicitTask
from celery_explicit.errors import LeaseLost, StaleFencingToken
from tests.celery_app import app

#: Where the worker runs: its host namespace's name, set by the test.
HOST_ENV = "EXPLICIT_CHAOS_HOST"
#: How long the first execution waits for the test to say "proceed" (the link is back).
PROCEED_WAIT = 180.0


def markers() -> redis.Redis:
    """The markers' Redis (the state store), with short timeouts: across a cut link a
    command fails fast and is tried again, instead of waiting on TCP retransmits."""
    from django.conf import settings

    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1, socket_connect_timeout=1)


def _push(client: redis.Redis, key: str, value: str, *, wait: float = PROCEED_WAIT) -> int:
    deadline = time.monotonic() + wait
    while True:
        try:
            return int(client.rpush(key, value))
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _backend_pid() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


class HostJob(ExplicitTask):
    name = "chaos.host_job"
    idempotency_key = "chaos:{run}:{job}"
    # Short, so a cut of a few seconds outlasts it; the handler's own run is short
    # except on the first host, which the test keeps waiting across the cut.
    visibility_timeout = 4
    expected_duration = 1
    retry_on = ()
    fail_on = ()
    max_deliveries = 5

    def run(self, run: str, job: int, guard: int) -> None:
        from django.db import DatabaseError, connection, transaction

        from django_outbox.store.guarded_writes import fenced_update
        from tests.chaos import history
        from tests.testapp.models import Profile

        host = os.environ.get(HOST_ENV, "?")
        client = markers()
        me = f"{host}:{os.getpid()}"
        # Read the row first, as a handler reads what it will write: this host then
        # holds a PostgreSQL connection across the cut, and commits (or is refused) on it.
        rows = Profile.objects.filter(user_id=guard)
        rows.exists()
        backend = _backend_pid()
        if _push(client, f"hosts:started:{run}:{job}", me) == 1:
            # The first execution: the test cuts this host's link now, past the lease,
            # and says proceed once the link is back.
            deadline = time.monotonic() + PROCEED_WAIT
            while time.monotonic() < deadline:
                try:
                    if client.exists(f"hosts:proceed:{run}:{job}"):
                        break
                except redis.RedisError:
                    pass  # the link is cut: keep waiting
                time.sleep(0.2)
            # Whether this host's PostgreSQL connection lived through the cut (the same
            # server backend answers), for the test's figures.
            try:
                after = "survived" if _backend_pid() == backend else "new backend"
            except DatabaseError:
                connection.close()  # reset across the cut: the effect opens a new one
                after = "reset"
            _push(client, f"hosts:pg:{run}:{job}", after)
        token = self.fencing_token
        with transaction.atomic():
            if token is None:
                rows.update(data=me)  # no execution lease: no token to guard with
            else:
                try:
                    fenced_update(rows, token=token, data=me)
                except StaleFencingToken as exc:
                    raise LeaseLost(
                        f"effect of chaos:{run}:{job}",
                        token=token,
                        current=exc.current,
                        why="a newer execution of this job took its lease over",
                    ) from exc
            history.record_effect(run, job, os.getpid())
        _push(client, f"hosts:applied:{run}:{job}", me)


app.register_task(HostJob())


#: The client's command line: not ``-m`` on this module, which would register the task a
#: second time under ``__main__``.
CLIENT = "import django; django.setup(); from tests.chaos.tasks_hosts import serve; serve()"


def _answer(value: object) -> None:
    print(json.dumps(value, default=str), flush=True)


def serve() -> None:
    """The test's hands in the services' database (see the module docstring)."""
    import psycopg
    from django.core.management import call_command
    from django.db import connection

    from django_outbox.models import Fence
    from tests.chaos import history
    from tests.testapp.models import Profile

    queue = os.environ["EXPLICIT_TEST_QUEUE"]
    for line in sys.stdin:
        command, *args = line.split()
        if command == "setup":
            params = connection.get_connection_params()
            name = connection.settings_dict["NAME"]
            with psycopg.connect(
                host=params["host"], port=params["port"], user=params["user"], dbname="postgres"
            ) as admin:
                admin.autocommit = True
                if not admin.execute(
                    "SELECT 1 FROM pg_database WHERE datname = %s", [name]
                ).fetchone():
                    admin.execute(f'CREATE DATABASE "{name}"')
            call_command("migrate", verbosity=0)
            history.ensure_tables()
            _answer("ok")
        elif command == "publish":
            run, job, guard = args[0], int(args[1]), int(args[2])
            Profile.objects.get_or_create(user_id=guard)
            history.record_published(run, [job])
            HostJob().apply_async(kwargs={"run": run, "job": job, "guard": guard}, queue=queue)
            _answer("ok")
        elif command == "check":
            run = args[0]
            counts = history.check(run)
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT split_part(idempotency_key, ':', 3)::int, worker_pid, outcome "
                    "FROM django_outbox_attempt WHERE idempotency_key LIKE %s "
                    "ORDER BY started_at",
                    [f"chaos:{run}:%"],
                )
                attempts = cursor.fetchall()
                cursor.execute(
                    "SELECT job, pid FROM chaos_effect WHERE run = %s ORDER BY id", [run]
                )
                effects = cursor.fetchall()
            fences = Fence.objects.count()
            _answer(
                {
                    "counts": counts.__dict__,
                    "attempts": attempts,
                    "effects": effects,
                    "fences": fences,
                }
            )
        else:
            _answer(f"unknown command {command}")
