import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

app = Celery("bench")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.task_default_queue = os.environ.get("EXPLICIT_BENCH_QUEUE", "bench")
app.autodiscover_tasks(["bench.benchapp"])
