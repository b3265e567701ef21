import os
import time

import django
from celery import Celery

# A worker whose host clock is off by EXPLICIT_TEST_CLOCK_SKEW seconds: every
# time.time() of the process, kombu's included (its Redis transport imports time()
# when it loads, after this module).
if _skew := float(os.environ.get("EXPLICIT_TEST_CLOCK_SKEW", "0")):
    _host_time = time.time
    time.time = lambda: _host_time() + _skew  # type: ignore[assignment]

# The failover tests' negative control: a redelivered job that finds its execution lease
# free runs without writing its fence row (what the lease did before it did).
if os.environ.get("EXPLICIT_TEST_NO_REDELIVERY_FENCE") == "1":
    from celery_explicit.execution_lease_step import ExecutionLeaseStep
    from celery_explicit.steps import RUN

    ExecutionLeaseStep._fence_unleased = lambda self, execution: RUN  # type: ignore[method-assign]

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

# A worker that counts each job's round trips from its pool processes
# (tests/integration/test_round_trips_per_job.py).
if os.environ.get("EXPLICIT_TEST_COUNT_ROUND_TRIPS"):
    from tests.support import round_trips

    round_trips.install()

app = Celery("tests")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Each test starts its workers on a queue of its own (no test sees another's messages).
app.conf.task_default_queue = os.environ.get("EXPLICIT_TEST_QUEUE", "explicit-tests")
app.autodiscover_tasks(["tests.testapp"])
# EXPLICIT_TEST_BEAT_TAG: the beat tests' entry (tests/fault/test_periodic.py), every
# second, run by the beats they start.
if _beat_tag := os.environ.get("EXPLICIT_TEST_BEAT_TAG"):
    app.conf.beat_schedule = {
        f"slot-report-{_beat_tag}": {
            "task": "tests.slot_report",
            "schedule": 1.0,
            "kwargs": {"tag": _beat_tag, "slot": "plain"},
        }
    }
# The django.tasks functions (django_outbox.tasks_backend) exist from Django 6.1 on.
if django.VERSION >= (6, 1):
    app.autodiscover_tasks(["tests.testapp"], related_name="django_tasks")
