"""Redis state stays bounded: a finished job leaves no key that outlives its lease.

A real worker runs a few hundred jobs of every kind (plain, retried, deduplicated,
ordered); then every key under our prefix that names one of those jobs must expire
within the job's lease, and each ordered entity, now idle, keeps only its two counters
for the idle horizon. The negative control runs the same jobs on a worker whose
execution lease release keeps the job's fence counter (the behaviour before it was
deleted with the lease): one key per job then outlives the lease by a day.

``measure()`` is also what docs/reliability.md's figure comes from (keys and bytes per
million finished jobs); ``EXPLICIT_GROWTH_JOBS`` scales it up.
"""

from __future__ import annotations

import os
import random
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from django.db import connection

from celery_explicit import ordering
from celery_explicit.locks import LeaseLock
from django_outbox.models import Attempt, Outcome
from tests.support.processes import ManagedProcess, project_env
from tests.support.waiting import wait_for
from tests.testapp.tasks import ApplyOrderEvent, Increment, RecordEvent, RetryThenSucceed

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]

PREFIX = "explicit:"  # the test project's EXPLICIT_KEY_PREFIX (the default)
#: The longest lease of the tasks run here (their visibility_timeout).
LEASE = max(
    task.visibility_timeout for task in (Increment, RetryThenSucceed, RecordEvent, ApplyOrderEvent)
)
#: Jobs of each kind (ordered ones: entities of ``EVENTS_PER_ENTITY`` events).
JOBS = int(os.environ.get("EXPLICIT_GROWTH_JOBS", "150"))
EVENTS_PER_ENTITY = 5

# A worker whose execution lease release keeps the job's fence counter, as every
# version did before the release deleted it (the counter then lived a day).
KEEPING_THE_COUNTER = """
import sys
from celery_explicit import execution_lease
from celery_explicit.redis_scripts import Script
execution_lease.RELEASE = Script(
    "execution_lease_release_keeping_the_counter",
    '''
local value = redis.call('get', KEYS[2])
if value and string.match(value, '^(%d+)|') == ARGV[1] then
    redis.call('del', KEYS[1], KEYS[2])
    return 1
end
return 0
''',
)
sys.argv = ["celery", *sys.argv[1:]]
from celery.__main__ import main
main()
"""


class GrowthWorker(ManagedProcess):
    """A prefork worker on ``queue``; with ``keep_counter`` the negative control's."""

    kind = "worker"
    ready_marker = " ready."

    def __init__(self, *, queue: str, log_dir: Path, keep_counter: bool) -> None:
        name = f"w{uuid.uuid4().hex[:6]}"
        program = ["-c", KEEPING_THE_COUNTER] if keep_counter else ["-m", "celery"]
        # fmt: off
        command = [
            sys.executable, *program, "-A", "tests.celery_app", "worker", "-Q", queue,
            "-c", "4", "-P", "prefork", "-n", f"{name}@%h", "--without-gossip",
            "--without-mingle", "--without-heartbeat", "-l", "INFO",
        ]
        # fmt: on
        db_name = str(connection.settings_dict["NAME"])
        super().__init__(
            command, name=name, log_dir=log_dir, env=project_env(db_name=db_name, queue=queue)
        )


@pytest.fixture
def start_growth_worker(
    transactional_db: None, queue: str, tmp_path: Path, redis_client: redis.Redis
) -> Iterator[Callable[..., GrowthWorker]]:
    started: list[GrowthWorker] = []

    def start(*, keep_counter: bool = False) -> GrowthWorker:
        worker = GrowthWorker(queue=queue, log_dir=tmp_path, keep_counter=keep_counter)
        started.append(worker)
        return worker.wait_ready(timeout=60)

    yield start
    for worker in started:
        worker.stop()
    redis_client.delete(queue)


@dataclass
class Left:
    """What a run left under our prefix, once its jobs had finished."""

    jobs: int
    #: Keys naming one of the run's jobs (its task id or its arguments' tag), by TTL.
    job_keys: dict[str, int]
    #: Keys of the run's ordering entities, by TTL.
    entity_keys: dict[str, int]
    #: Every new key under our prefix and its MEMORY USAGE, in bytes.
    bytes_by_key: dict[str, int]

    def outliving_the_lease(self) -> list[str]:
        """Job keys with no TTL or one longer than the lease."""
        return sorted(k for k, ttl in self.job_keys.items() if ttl < 0 or ttl > LEASE)

    def per_million(self, keys: dict[str, int]) -> tuple[float, float]:
        """(keys, bytes) of ``keys`` scaled to a million finished jobs."""
        scale = 1_000_000 / self.jobs
        used = sum(self.bytes_by_key.get(k, 0) for k in keys)
        return len(keys) * scale, used * scale


def _our_keys(client: redis.Redis) -> set[str]:
    return {key.decode() for key in client.scan_iter(match=f"{PREFIX}*", count=1000)}


def run_jobs(client: redis.Redis, queue: str) -> Left:
    """Publish every kind of job, wait for each to finish and its lease to be given
    back, and read what is left."""
    before = _our_keys(client)
    tag = uuid.uuid4().hex[:10]
    ids: list[str] = []
    for i in range(JOBS):
        ids.append(Increment().apply_async(args=[f"{tag}-p", f"{i}"], queue=queue).id)
        # A retry: a transient error first, then success on a second message.
        ids.append(RetryThenSucceed().apply_async(args=[f"{tag}-r{i}", 1], queue=queue).id)
        event = f"{tag}-e{i}"
        ids.append(RecordEvent().apply_async(args=[event, f"{tag}-d"], queue=queue).id)
        RecordEvent().apply_async(args=[event, f"{tag}-d"], queue=queue)  # dropped: dedup
    entities = [
        random.randrange(10**8, 2 * 10**9) for _ in range(max(1, JOBS // EVENTS_PER_ENTITY))
    ]
    for entity in entities:
        for seq in range(EVENTS_PER_ENTITY):
            ids.append(ApplyOrderEvent().apply_async(args=[entity, seq, tag], queue=queue).id)
    for i in range(JOBS):
        # Locks, one name each (a lock per entity): the name's fence counter goes with it.
        with LeaseLock(client, f"{tag}-lock:{i}", ttl=LEASE, prefix=PREFIX).hold():
            pass
    finished = (Outcome.APPLIED, Outcome.SUCCEEDED, Outcome.ALREADY_APPLIED)

    def ended() -> bool:
        done = Attempt.objects.filter(task_id__in=ids, outcome__in=finished)
        return done.values("task_id").distinct().count() == len(set(ids))

    def outcomes() -> list[tuple[str, str, int]]:
        rows = Attempt.objects.filter(task_id__in=ids).values_list("task_name", "outcome")
        return sorted({(n, o, list(rows).count((n, o))) for n, o in rows})

    wait_for(
        ended,
        timeout=60 + JOBS,
        interval=0.5,
        what=f"{len(ids)} jobs to finish",
        on_timeout=outcomes,
    )
    # The attempt row is written before the lease is given back: wait for the releases.
    wait_for(
        lambda: not any(k.startswith(f"{PREFIX}run:") for k in _our_keys(client) - before),
        timeout=30,
        what="every execution lease to be released",
    )
    new = sorted(_our_keys(client) - before)
    names = [f"{{{task_id}}}" for task_id in ids] + [task_id for task_id in ids] + [tag]
    pipe = client.pipeline(transaction=False)
    for key in new:
        pipe.ttl(key)
        pipe.memory_usage(key)
    replies = pipe.execute()
    ttls = dict(zip(new, replies[0::2], strict=True))
    used = {key: int(size or 0) for key, size in zip(new, replies[1::2], strict=True)}
    entity_marks = tuple(f"order:{{order:{entity}}}" for entity in entities)
    return Left(
        jobs=len(ids),
        job_keys={k: t for k, t in ttls.items() if any(n in k for n in names)},
        entity_keys={
            k: t
            for k, t in ttls.items()
            if k.startswith(PREFIX) and any(m in k for m in entity_marks)
        },
        bytes_by_key=used,
    )


def test_finished_jobs_leave_no_key_outliving_their_lease(
    start_growth_worker: Callable[..., GrowthWorker], redis_client: redis.Redis, queue: str
) -> None:
    start_growth_worker()
    left = run_jobs(redis_client, queue)
    assert left.outliving_the_lease() == []
    # An idle entity keeps its two counters for the idle horizon, nothing else.
    suffixes = {key.rsplit(":", 1)[1] for key in left.entity_keys}
    assert suffixes <= {"published", "next"}, left.entity_keys
    assert all(0 < ttl <= ordering.IDLE_TTL for ttl in left.entity_keys.values())
    print(f"\n{summary(left)}")


def test_negative_control_a_kept_fence_counter_outlives_every_job(
    start_growth_worker: Callable[..., GrowthWorker], redis_client: redis.Redis, queue: str
) -> None:
    start_growth_worker(keep_counter=True)
    left = run_jobs(redis_client, queue)
    kept = [key for key in left.outliving_the_lease() if f"{PREFIX}run-fence:" in key]
    # One per job that ran (a deduplicated copy never does): growth with the job count.
    assert len(kept) >= left.jobs, len(kept)
    redis_client.delete(*kept)


def summary(left: Left) -> dict[str, Any]:
    """Keys and bytes left per million finished jobs, by kind of key (the head of its
    name after the prefix) and their longest TTL; and those that outlive the lease."""
    kinds: dict[str, dict[str, int]] = {}
    for key, ttl in {**left.job_keys, **left.entity_keys}.items():
        kind = key[len(PREFIX) :].split(":", 1)[0]
        if kind == "order":
            kind += ":" + key.rsplit(":", 1)[1]
        kinds.setdefault(kind, {})[key] = ttl
    after = {k: t for k, t in {**left.job_keys, **left.entity_keys}.items() if t > LEASE}
    return {
        "jobs": left.jobs,
        "left after the lease, per million": left.per_million(after),
        **{
            kind: {
                "keys/M": round(left.per_million(keys)[0]),
                "bytes/M": round(left.per_million(keys)[1]),
                "max ttl": max(keys.values()),
            }
            for kind, keys in sorted(kinds.items())
        },
    }
