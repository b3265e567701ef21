import os
import time

from celery import Celery

# A worker whose host clock is off by EXPLICIT_TEST_CLOCK_SKEW seconds: every
# time.time() of the process, kombu's included (its Redis transport imports time()
# when it loads, after this module).
if _skew := float(os.environ.get("EXPLICIT_TEST_CLOCK_SKEW", "0")):
    _host_time = time.time
    time.time = lambda: _host_time() + _skew  # type: ignore[assignment]

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

app = Celery("tests")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Each test starts its workers on a queue of its own (no test sees another's messages).
app.conf.task_default_queue = os.environ.get("EXPLICIT_TEST_QUEUE", "explicit-tests")
app.autodiscover_tasks(["tests.testapp"])
