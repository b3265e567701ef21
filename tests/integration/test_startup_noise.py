"""A worker says one thing once: a refused contract is one line and exit status 1; an
error nobody classified leaves one traceback in the log.

The refusal runs real ``celery worker`` processes on a small project written into the
test's directory: a Django app whose ``tasks`` module registers a valid task, then
declares one that is refused. Celery's Django fixup runs the checks (which import the
task modules) before Celery imports them itself: a module imported again after its
failure used to register the valid task again each time (DuplicateTaskNameWarning),
and the error came out as an 86-line traceback.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from django_outbox.models import Attempt, Outcome
from tests.support.processes import ROOT
from tests.support.waiting import wait_for
from tests.testapp.tasks import Surprising

pytestmark = [pytest.mark.worker]

SETTINGS = """
import os
SECRET_KEY = "startup-noise"
USE_TZ = True
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "django_outbox",
                  "noisyshop"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3",
                         "NAME": os.path.join(os.path.dirname(__file__), "db.sqlite3")}}
CELERY_BROKER_URL = os.environ["NOISE_BROKER_URL"]
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 3600,
    "unacked_restore_interval": 1, "unacked_restore_throttle": 1}
"""

CELERY = """
import os
from celery import Celery
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "noisyproj.settings")
app = Celery("noisyproj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
"""

VALID = """
from celery_explicit import ExplicitTask
from noisyproj.celery import app


class CapturePayment(ExplicitTask):
    name = "noisyshop.capture_payment"
    idempotency_key = "payment:{payment_id}:capture"
    visibility_timeout = 60
    expected_duration = 5
    retry_on = ()
    fail_on = ()

    def run(self, payment_id):
        return None


app.register_task(CapturePayment())
"""

#: A task refused after the valid one, in each of the two ways a task is declared.
REFUSED = {
    "class": """

class ShipOrder(ExplicitTask):
    name = "noisyshop.ship_order"
    idempotency_key = "order:{order_id}:ship"
    visibility_timeout = {lease}
    expected_duration = 45
    retry_on = ()
    fail_on = ()

    def run(self, order_id):
        return None


app.register_task(ShipOrder())
""",
    "decorator": """

@app.task(base=ExplicitTask, name="noisyshop.ship_order",
          idempotency_key="order:{order_id}:ship", visibility_timeout={lease},
          expected_duration=45, retry_on=(), fail_on=())
def ship_order(order_id):
    return None
""",
}


def project(root: Path, how: str, lease: int) -> Path:
    """The project, its ship_order task declared ``how`` with ``lease`` seconds."""
    (root / "noisyproj").mkdir()
    (root / "noisyproj" / "__init__.py").write_text(
        "from .celery import app as celery_app\n\n__all__ = ('celery_app',)\n"
    )
    (root / "noisyproj" / "celery.py").write_text(CELERY)
    (root / "noisyproj" / "settings.py").write_text(SETTINGS)
    (root / "noisyshop").mkdir()
    (root / "noisyshop" / "__init__.py").write_text("")
    refused = REFUSED[how].replace("{lease}", str(lease))
    (root / "noisyshop" / "tasks.py").write_text(VALID + refused)
    return root


def start(root: Path) -> subprocess.Popen[str]:
    from django.conf import settings

    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(root),
        "LANG": "C.UTF-8",
        "PYTHONPATH": f"{root}:{ROOT}",
        "NOISE_BROKER_URL": settings.REDIS_URL,
    }
    # fmt: off
    command = [
        sys.executable, "-m", "celery", "-A", "noisyproj", "worker", "-c", "1",
        "-Q", f"q-{uuid.uuid4().hex[:10]}", "--without-gossip", "--without-mingle",
        "--without-heartbeat", "-l", "INFO",
    ]
    # fmt: on
    return subprocess.Popen(
        command,
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("how", ["class", "decorator"])
def test_a_refused_contract_is_one_line_and_exit_status_1(tmp_path: Path, how: str) -> None:
    worker = start(project(tmp_path, how, lease=30))
    try:
        out, err = worker.communicate(timeout=90)
    finally:
        worker.kill()
    assert worker.returncode == 1, err[-3000:]
    lines = err.splitlines()
    assert len(lines) == 1, err[-3000:]
    [line] = lines
    assert line.startswith("worker refuses to start: Task noisyshop.ship_order: "), line
    assert "visibility_timeout=30s" in line and "declare at least 90s" in line, line
    assert "Traceback" not in err and "DuplicateTaskNameWarning" not in err
    assert out == ""


def test_the_same_project_with_the_contract_kept_starts(tmp_path: Path) -> None:
    """The control: the same project, the lease long enough, starts cleanly."""
    worker = start(project(tmp_path, "class", lease=120))
    assert worker.stderr is not None
    lines: list[str] = []
    try:
        for line in worker.stderr:
            lines.append(line)
            if " ready." in line:
                break
    finally:
        worker.terminate()
        worker.communicate(timeout=30)
    text = "".join(lines)
    assert " ready." in text, text[-3000:]
    assert "Traceback" not in text and "DuplicateTaskNameWarning" not in text


@pytest.mark.django_db(transaction=True)
def test_an_error_nobody_classified_leaves_one_traceback(start_worker: Any, queue: str) -> None:
    failures = 3
    worker = start_worker()
    for n in range(failures):
        Surprising().apply_async(args=[f"parcel-{uuid.uuid4().hex[:6]}-{n}"], queue=queue)
    wait_for(
        lambda: Attempt.objects.filter(outcome=Outcome.FAILED_UNCLASSIFIED).count() == failures,
        what="three unclassified failures",
    )

    def log_with_every_line() -> str | None:
        text: str = worker.log()
        return text if text.count("raised unexpected: LookupError") == failures else None

    log = wait_for(log_with_every_line, timeout=10, what="Celery's line for each failure")
    assert log.count("failed_unclassified in") == failures, log[-4000:]
    # Ours keeps the traceback (it names the job and key); Celery's line is one line.
    assert log.count("Traceback (most recent call last)") == failures, log[-6000:]
    for line in log.splitlines():
        if "raised unexpected" in line:
            after = log.split(line, 1)[1].lstrip("\n")
            assert not after.startswith("Traceback"), after[:400]
