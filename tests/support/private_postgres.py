"""A PostgreSQL cluster of a test's own, for faults that take the database away.

initdb in a temp dir, its own port, stopped and started by ``pg_ctl`` (which signals
the postmaster named in the cluster's own pid file: no other server is touched).
initdb refuses to run as root: as root, every command runs as the ``postgres`` user
(``runuser``), in a directory it owns.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psycopg

from tests.support.ports import free_port
from tests.support.processes import ROOT, project_env

PG_BIN = Path("/usr/lib/postgresql/15/bin")


class PrivatePostgres:
    def __init__(self, db_name: str, *, prefix: str = "ce-pg-") -> None:
        self.db_name = db_name
        self.base = Path(tempfile.mkdtemp(prefix=prefix))
        self.data = self.base / "data"
        self.port = free_port()
        self.dsn = f"host=127.0.0.1 port={self.port} user=postgres dbname={db_name}"
        if os.geteuid() == 0:
            shutil.chown(self.base, "postgres", "postgres")

    def _run(self, *command: str, timeout: float = 120.0) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        done = subprocess.run(
            [*prefix, *command], capture_output=True, text=True, timeout=timeout, check=False
        )
        if done.returncode:
            log = self.base / "server.log"
            raise RuntimeError(
                f"{command[0]} failed ({done.returncode}): {done.stdout}{done.stderr}"
                f"{log.read_text() if log.exists() else ''}"
            )

    def init(self) -> None:
        self._run(
            str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
            "--no-sync",
        )  # fmt: skip

    def start(self) -> None:
        options = f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1"
        self._run(
            str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.base / "server.log"),
            "-o", options, "-w", "-t", "120", "start",
        )  # fmt: skip

    def crash(self) -> None:
        """Immediate stop: the postmaster and its backends quit at once, no checkpoint;
        the next start replays the WAL as after a crash."""
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def stop(self) -> None:
        """Fast stop, as an operator's restart does: sessions end with 57P01."""
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def read_only(self, on: bool) -> None:
        """Every transaction read-only from now (existing sessions too, at their next
        transaction: the reload reaches every backend), as on a standby."""
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(
                "ALTER SYSTEM SET default_transaction_read_only = " + ("on" if on else "off")
            )
            conn.execute("SELECT pg_reload_conf()")

    @property
    def admin_dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def create_project_database(self, queue: str) -> None:
        """The database and the project's tables, migrated the way a deployment would:
        the workers' own settings, pointed at this cluster."""
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {self.db_name}")
        subprocess.run(
            [sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"],
            cwd=ROOT,
            env=project_env(db_name=self.db_name, queue=queue, extra=self.env()),
            check=True,
            timeout=300,
        )

    def env(self) -> dict[str, str]:
        """What points a process of the test project at this cluster (tests/settings.py
        reads PGHOST / PGPORT / EXPLICIT_TEST_DB_NAME)."""
        return {
            "PGHOST": "127.0.0.1",
            "PGPORT": str(self.port),
            "EXPLICIT_TEST_DB_NAME": self.db_name,
        }

    def query(self, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return list(conn.execute(sql, params or []).fetchall())

    def destroy(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.stop()
        shutil.rmtree(self.base, ignore_errors=True)
