import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

app = Celery("tests")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Each test starts its workers on a queue of its own (no test sees another's messages).
app.conf.task_default_queue = os.environ.get("EXPLICIT_TEST_QUEUE", "explicit-tests")
app.autodiscover_tasks(["tests.testapp"])
