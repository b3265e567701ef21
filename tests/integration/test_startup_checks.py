"""A worker whose configuration ``manage.py check`` rejects refuses to start.

Real ``celery worker`` processes on the test settings, with a broker backstop (the
Redis ``visibility_timeout``) of 5 s: shorter than the tasks' own leases, which is
``django_outbox.E003``."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
from django.db import connection

from tests.support.processes import ROOT, project_env

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def start(extra: dict[str, str]) -> subprocess.Popen[str]:
    queue = f"q-{uuid.uuid4().hex[:10]}"
    env = project_env(db_name=connection.settings_dict["NAME"], queue=queue, extra=extra)
    # fmt: off
    command = [
        sys.executable, "-m", "celery", "-A", "tests.celery_app", "worker", "-Q", queue,
        "-c", "1", "-P", "prefork", "--without-gossip", "--without-mingle",
        "--without-heartbeat", "-l", "INFO",
    ]
    # fmt: on
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_a_worker_with_a_check_error_refuses_to_start_and_says_why() -> None:
    worker = start({"EXPLICIT_TEST_BACKSTOP": "5"})
    try:
        out, _ = worker.communicate(timeout=90)
    finally:
        worker.kill()
    assert worker.returncode == 1, out[-3000:]
    assert "worker refuses to start" in out
    assert "django_outbox.E003" in out
    assert " ready." not in out


def test_the_setting_lets_it_start_with_the_errors_as_warnings() -> None:
    """The negative control: the same configuration starts when told to."""
    worker = start({"EXPLICIT_TEST_BACKSTOP": "5", "EXPLICIT_TEST_START_ANYWAY": "1"})
    lines: list[str] = []
    try:
        assert worker.stdout is not None
        for line in worker.stdout:
            lines.append(line)
            if " ready." in line:
                break
    finally:
        worker.terminate()
        worker.communicate(timeout=30)
    out = "".join(lines)
    assert " ready." in out, out[-3000:]
    assert "starting despite check errors" in out
    assert "django_outbox.E003" in out
