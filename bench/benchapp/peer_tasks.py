"""The bench's row update as the peers do it (bench/peers.py).

The same business job as ``bench.plain_update`` and ``bench.explicit_update``
(bench/benchapp/tasks.py): one PostgreSQL row update in a transaction, for one
``op_id``. Each peer guards it its own way:

- ``bench.once_update``: celery-once's ``QueueOnce`` (a redis-py ``Lock`` taken in
  ``apply_async``, keyed on ``op_id``, cleared when the task returns);
- ``bench.singleton_update``: celery-singleton's ``Singleton`` (a ``SET NX`` of the task
  id in ``apply_async``, keyed on ``op_id``, deleted on success or failure);
- ``bench.explicit_dedup_update``: the ExplicitTask of tasks.py plus ``dedup_key``
  (a second message with the same ``op_id`` is dropped at publish for 60 s);
- ``bench.handrolled_update``: a plain task guarded the way people do it by hand, a
  redis-py ``Lock`` around the body and ``get_or_create`` of a processed-key row in the
  effect's transaction.

celery-once and celery-singleton keep their locks on the Redis our leases use
(``EXPLICIT_REDIS_URL``). Not found by the app's ``autodiscover_tasks`` (which imports
``tasks`` modules only): a worker running them is started with
``-I bench.benchapp.peer_tasks``. Needs the peer packages (``pip install celery-once
celery-singleton``).
"""

from __future__ import annotations

from typing import Any

from celery_once import QueueOnce
from celery_singleton import Singleton
from django.conf import settings
from django.db import transaction
from django.db.models import F

from bench.benchapp.models import ProcessedKey, Row
from bench.benchapp.tasks import ExplicitUpdate
from bench.celery_app import app

#: celery-once's documented configuration: its Redis backend, locks expire after 1 h
#: (its default) unless the task returns first.
app.conf.ONCE = {
    "backend": "celery_once.backends.Redis",
    "settings": {"url": settings.EXPLICIT_REDIS_URL, "default_timeout": 60 * 60},
}
#: celery-singleton's lock store (without it: the result backend or the broker).
app.conf.singleton_backend_url = settings.EXPLICIT_REDIS_URL


def _update(row_id: int) -> None:
    with transaction.atomic():
        Row.objects.filter(id=row_id).update(value=F("value") + 1)


@app.task(
    name="bench.once_update",
    base=QueueOnce,
    acks_late=True,
    once={"graceful": True, "keys": ["op_id"]},
)
def once_update(row_id: int, op_id: str) -> None:
    _update(row_id)


@app.task(name="bench.singleton_update", base=Singleton, acks_late=True, unique_on=["op_id"])
def singleton_update(row_id: int, op_id: str) -> None:
    _update(row_id)


class ExplicitDedupUpdate(ExplicitUpdate):
    name = "bench.explicit_dedup_update"
    dedup_key = "{op_id}"
    dedup_window = 60


app.register_task(ExplicitDedupUpdate())


# --- by hand: a redis-py Lock around the body, a processed-key row in the transaction --


_redis: Any = None


@app.task(name="bench.handrolled_update", acks_late=True)
def handrolled_update(row_id: int, op_id: str) -> None:
    global _redis
    if _redis is None:
        import redis

        _redis = redis.Redis.from_url(settings.EXPLICIT_REDIS_URL)
    lock = _redis.lock(f"bench:hand:{op_id}", timeout=30, blocking_timeout=10)
    with lock, transaction.atomic():
        _, created = ProcessedKey.objects.get_or_create(key=f"bench:{op_id}")
        if created:
            Row.objects.filter(id=row_id).update(value=F("value") + 1)
