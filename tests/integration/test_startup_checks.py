"""A worker whose configuration ``manage.py check`` rejects refuses to start.

Real ``celery worker`` processes on the test settings, with a broker backstop (the
Redis ``visibility_timeout``) of 5 s: shorter than the tasks' own leases, which is
``django_outbox.E003``."""

from __future__ import annotations

import subprocess

import pytest
from django.db import connection

from tests.support.workers import lines_until_ready, refusal, start_checked

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def start(extra: dict[str, str]) -> subprocess.Popen[str]:
    return start_checked(db_name=connection.settings_dict["NAME"], extra_env=extra)


def test_a_worker_with_a_check_error_refuses_to_start_and_says_why() -> None:
    worker = start({"EXPLICIT_TEST_BACKSTOP": "5"})
    out, _ = refusal(worker)
    assert worker.returncode == 1, out[-3000:]
    assert "worker refuses to start" in out
    assert "django_outbox.E003" in out
    assert " ready." not in out


def test_the_setting_lets_it_start_with_the_errors_as_warnings() -> None:
    """The negative control: the same configuration starts when told to."""
    worker = start({"EXPLICIT_TEST_BACKSTOP": "5", "EXPLICIT_TEST_START_ANYWAY": "1"})
    out = "".join(lines_until_ready(worker))
    assert " ready." in out, out[-3000:]
    assert "starting despite check errors" in out
    assert "django_outbox.E003" in out
