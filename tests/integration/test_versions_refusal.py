"""A real ``celery worker`` on an untested Celery refuses to start, in one line.

Another Celery cannot be installed for one test, so the worker is started through a
small wrapper that narrows ``celery_explicit.versions.TESTED`` to a range the installed
Celery and kombu are outside of, then runs Celery's own command line
(``celery -A tests.celery_app worker ...``) in that process. Nothing in the package
reads a testing switch: the wrapper changes the same constant a release would.
The unit tests (tests/unit/test_versions_checks.py) cover the check and the report."""

from __future__ import annotations

import subprocess

import celery
import kombu
import pytest
from django.db import connection

from tests.support.workers import lines_until_ready, refusal, start_checked

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]

WRAPPER = """
import sys
from celery_explicit import versions
versions.TESTED = {"celery": versions.Range("99", "100"), "kombu": versions.Range("99", "100")}
if sys.argv[1] == "allow":
    from django.conf import settings  # tests.settings, from DJANGO_SETTINGS_MODULE
    settings.EXPLICIT_ALLOW_UNTESTED_VERSIONS = True
sys.argv = ["celery", *sys.argv[2:]]
from celery.__main__ import main
main()
"""


def start(mode: str) -> subprocess.Popen[str]:
    return start_checked(
        db_name=connection.settings_dict["NAME"], program=("-c", WRAPPER, mode), stderr_apart=True
    )


def test_a_worker_on_untested_versions_refuses_to_start_in_one_line() -> None:
    worker = start("refuse")
    out, err = refusal(worker)
    assert worker.returncode == 1, (out + err)[-3000:]
    [line] = [x for x in err.splitlines() if "worker refuses to start" in x]
    assert (
        f"tested with Celery >=99,<100 and kombu >=99,<100; installed: "
        f"Celery {celery.__version__} (untested) and kombu {kombu.__version__} (untested)"
    ) in line
    assert "EXPLICIT_ALLOW_UNTESTED_VERSIONS" in line
    assert " ready." not in out + err


def test_the_override_lets_it_start_with_one_warning() -> None:
    """The negative control: the same versions start when the setting allows them."""
    lines = lines_until_ready(start("allow"))
    out = "".join(lines)
    assert " ready." in out, out[-3000:]
    assert "refuses to start" not in out
    [warning] = [x for x in lines if "starting with untested versions" in x]
    assert f"Celery {celery.__version__} (untested)" in warning
