"""README.md's quick start, followed as a new user would, with nothing else.

The wheel is built from this checkout and installed, with ``psycopg[binary]``, into a
fresh virtual environment (the dependencies come from pip's configured index, as in
test_wheel.py). ``django-admin startproject proj .`` and ``startapp shop`` make the
project; every code block of the quick start whose first line names a file is written
to that file (``: add at the end`` appends), so a snippet that breaks fails here. Then,
as the README says: ``manage.py check``, ``migrate``, ``celery -A proj worker -l INFO``
and ``manage.py explicit_relay``, and the ``# publish`` block in ``manage.py shell``:
one job published directly, one dispatched on commit, one durable through the outbox.
Each must be applied: its attempt row ``applied`` and its ledger row written.

Two lines are the test's own, beside the README's: the broker URL points at the test's
Redis database instead of ``/0``, and ``DATABASES`` at a PostgreSQL database created
for this test.
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.support.processes import ROOT, ManagedProcess, run
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.wheel, pytest.mark.worker]

README = ROOT / "README.md"
SECTION = "## Quick start in your project"
README_BROKER = "redis://127.0.0.1:6379/0"


def quick_start() -> str:
    text = README.read_text()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return text[start:end]


def blocks(section: str) -> dict[str, str]:
    """The section's code blocks by their first line (``# proj/celery.py``)."""
    found: dict[str, str] = {}
    for body in re.findall(r"^```(?:python|sh)\n(.*?)^```$", section, flags=re.S | re.M):
        first = body.split("\n", 1)[0]
        if first.startswith("# "):
            found[first[2:]] = body
    return found


@pytest.fixture
def database() -> Iterator[str]:
    """A PostgreSQL database of this test's own, dropped afterwards."""
    name = f"{os.environ.get('EXPLICIT_TEST_DATABASE', 'test_explicit')}_qs_{uuid.uuid4().hex[:6]}"
    admin = psycopg.connect(host="127.0.0.1", user="postgres", dbname="postgres", autocommit=True)
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def test_the_readme_names_each_step_it_takes() -> None:
    section = quick_start()
    for step in (
        "pip install /path/to/celery-explicit",
        "python -m build",
        "django-admin startproject proj .",
        "python manage.py startapp shop",
        "python manage.py migrate",
        "python manage.py check",
        "celery -A proj worker -l INFO",
        "python manage.py explicit_relay",
        "EXPLICIT_WORKER_METRICS_PORT",
        "EXPLICIT_METRICS_TOKEN",
        "docs/metrics.md",
    ):
        assert step in section, step
    assert set(blocks(section)) >= {
        "proj/celery.py",
        "proj/__init__.py",
        "proj/settings.py: add at the end",
        "shop/tasks.py",
        "publish",
    }, list(blocks(section))
    assert README_BROKER in blocks(section)["proj/settings.py: add at the end"]


@pytest.mark.timeout(900)  # a build, a venv, an install from the index, a worker
def test_the_quick_start_runs_one_job_of_each_kind(tmp_path: Path, database: str) -> None:
    from django.conf import settings

    snippets = blocks(quick_start())
    dist, venv, project = tmp_path / "dist", tmp_path / "venv", tmp_path / "project"
    run([sys.executable, "-m", "build", "--wheel", "--outdir", dist, ROOT], timeout=600)
    [wheel] = dist.glob("celery_explicit-*.whl")
    run([sys.executable, "-m", "venv", venv], timeout=120)
    python = venv / "bin" / "python"
    run([python, "-m", "pip", "install", "--quiet", wheel, "psycopg[binary]"], timeout=600)

    project.mkdir()
    # Only what a shell on a fresh machine has: no PYTHONPATH, no settings module.
    env = {
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
    }
    run(["django-admin", "startproject", "proj", "."], timeout=60, cwd=project, env=env)
    run([python, "manage.py", "startapp", "shop"], timeout=60, cwd=project, env=env)
    for first_line, body in snippets.items():
        path, _, how = first_line.partition(": ")
        if "/" not in path:
            continue  # not a file: the shell's blocks, the publish block
        target = project / path
        if how == "add at the end":
            target.write_text(target.read_text() + "\n" + body)
        else:
            assert not how, first_line
            target.write_text(body)
    settings_py = project / "proj" / "settings.py"
    settings_py.write_text(
        settings_py.read_text().replace(README_BROKER, settings.REDIS_URL)
        + "\nDATABASES = {'default': {'ENGINE': 'django.db.backends.postgresql', "
        f"'HOST': '127.0.0.1', 'USER': 'postgres', 'NAME': {database!r}}}}}\n"
    )

    where = run(
        [python, "-c", "import celery_explicit; print(celery_explicit.__file__)"],
        timeout=60, cwd=project, env=env,
    )  # fmt: skip
    assert Path(where.strip()).is_relative_to(venv), where

    checked = run([python, "manage.py", "check"], timeout=120, cwd=project, env=env)
    assert "System check identified no issues" in checked, checked
    run([python, "manage.py", "migrate"], timeout=300, cwd=project, env=env)

    worker = ManagedProcess(
        ["celery", "-A", "proj", "worker", "-l", "INFO"],
        name="worker", log_dir=tmp_path, env=env, cwd=project, ready=" ready.",
    )  # fmt: skip
    relay = ManagedProcess(
        [str(python), "manage.py", "explicit_relay"],
        name="relay", log_dir=tmp_path, env=env, cwd=project, ready="outbox relay ready",
    )  # fmt: skip
    try:
        worker.wait_ready(60)
        relay.wait_ready(60)
        run(
            [python, "manage.py", "shell", "-c", snippets["publish"]],
            timeout=120, cwd=project, env=env,
        )  # fmt: skip

        with psycopg.connect(host="127.0.0.1", user="postgres", dbname=database) as conn:

            def ledger() -> set[str] | None:
                rows = conn.execute("SELECT key FROM django_outbox_processed_operation")
                keys = {key for (key,) in rows}
                conn.commit()
                return keys if len(keys) >= 3 else None

            keys = wait_for(
                ledger, timeout=60, what="three ledger rows",
                on_timeout=lambda: worker.log()[-3000:] + relay.log()[-2000:],
            )  # fmt: skip
            assert keys == {"payment:1:capture", "invoice:7:send_email", "payment:2:capture"}
            attempts = conn.execute(
                "SELECT idempotency_key, outcome FROM django_outbox_attempt"
            ).fetchall()
            assert sorted(attempts) == [
                ("invoice:7:send_email", "applied"),
                ("payment:1:capture", "applied"),
                ("payment:2:capture", "applied"),
            ], attempts
            events = conn.execute("SELECT task_name, status FROM django_outbox_event").fetchall()
            assert events == [("shop.capture_payment", "published")], events
    finally:
        relay.stop()
        worker.stop()
    log = worker.log()
    assert "Traceback" not in log and "DuplicateTaskNameWarning" not in log, log[-4000:]
    assert str(ROOT / "celery_explicit") not in log
