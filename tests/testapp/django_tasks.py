"""``django.tasks`` functions run by real workers through django_outbox.tasks_backend.

Django 6.1 and later only: tests/celery_app.py has workers import this module there.
"""

from __future__ import annotations

import redis
from django.conf import settings
from django.db.models import F
from django.tasks import task

from celery_explicit import effect
from tests.testapp.models import Counter
from tests.testapp.tasks import TransientError

CONTRACT = {
    "visibility_timeout": 30,
    "expected_duration": 1,
    "retry_on": (TransientError,),
    "fail_on": (ValueError,),
    # Short, so the retry comes back within the test's wait.
    "backoff_base": 0.1,
    "backoff_cap": 0.2,
}


def _add_one(name: str) -> str:
    with effect() as e:
        if e.done:
            return e.result_ref
        Counter.objects.filter(name=name).update(value=F("value") + 1)
        e.result_ref = name
    return name


@task(idempotency_key="dt-add:{name}", **CONTRACT)
def add_one(name: str) -> str:
    return _add_one(name)


@task(idempotency_key="dt-flaky:{name}", **CONTRACT)
def add_one_after_failures(name: str, failures: int) -> str:
    """Raises the retryable error on its first ``failures`` runs (counted in Redis,
    which outlives the worker process that ran each), then adds one."""
    client, counted = redis.Redis.from_url(settings.REDIS_URL), f"dt-flaky-runs:{name}"
    runs = client.incr(counted)
    client.expire(counted, 300)
    if int(runs) <= failures:  # type: ignore[arg-type]
        raise TransientError(f"run {runs} of {name} fails")
    return _add_one(name)


@task(idempotency_key="dt-refuse:{name}", **CONTRACT)
def refuse(name: str) -> None:
    raise ValueError(f"{name} can never be applied")


@task(idempotency_key="dt-durable:{name}", durable=True, **CONTRACT)
def add_one_durably(name: str) -> str:
    return _add_one(name)
