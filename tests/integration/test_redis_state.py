"""Our Redis client: one kept connection in a prefork pool child, the pool elsewhere.

A prefork child runs one job at a time, so its client keeps one connection instead of
taking one from redis-py's pool on every call (``celery_explicit.redis_state``). These
tests run it against real Redis: the worker's children really get it, a client made
before a fork is never the child's, a connection the server drops is made again, and
threads sharing the kept connection still get their own replies.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_explicit import execution_lease, redis_state
from tests.support.waiting import wait_for
from tests.testapp.tasks import report_redis_client


@pytest.fixture
def pool_child() -> Iterator[None]:
    """This process as a prefork child (``worker_process_init``), undone afterwards."""
    redis_state.one_job_at_a_time()
    try:
        yield
    finally:
        redis_state._one_job_at_a_time_in = None
        with redis_state._clients_lock:
            redis_state._clients.clear()


def lease_cycles(client: redis.Redis, jobs: list[str]) -> list[int]:
    """Acquire and release each job's execution lease; the fences handed out."""
    fences = []
    for job in jobs:
        taken = execution_lease.acquire(job, ttl=5, client=client)
        assert isinstance(taken, execution_lease.Taken), (job, taken)
        assert execution_lease.release(job, taken.fence, client=client)
        fences.append(taken.fence)
    return fences


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_the_workers_pool_children_keep_one_connection(start_worker, queue, redis_client) -> None:
    start_worker(concurrency=2)
    tokens = [uuid.uuid4().hex for _ in range(6)]
    for token in tokens:
        report_redis_client.apply_async(args=[token], queue=queue)
    wait_for(lambda: all(redis_client.exists(f"probe:{t}") for t in tokens), timeout=30)
    reports = [redis_client.get(f"probe:{t}").decode().split("|") for t in tokens]
    assert {kept for _pid, kept in reports} == {"1"}, reports
    # The pool's processes, not the worker's main process (which pools: its lease keeper
    # extends many leases at once).
    assert all(int(pid) != os.getpid() for pid, _kept in reports)


def test_elsewhere_the_client_takes_its_connections_from_the_pool() -> None:
    client = redis_state.client()
    assert client.connection is None
    assert client is redis_state.client()  # one per URL and process
    assert client.ping()


def test_in_a_pool_child_the_lease_runs_on_the_kept_connection(pool_child, redis_client) -> None:
    client = redis_state.client()
    assert client.connection is not None
    connection_id = client.client_id()
    prefix = f"job-{uuid.uuid4().hex[:8]}"
    fences = lease_cycles(client, [f"{prefix}-{i}" for i in range(20)])
    assert len(set(fences)) == 20
    assert client.client_id() == connection_id  # the same connection, every call


def test_a_kept_connection_the_server_drops_is_made_again(pool_child, redis_client) -> None:
    client = redis_state.client()
    first = client.client_id()
    redis_client.client_kill_filter(_id=first)
    # The next job's lease is taken on a new connection, not refused with an error.
    job = f"job-{uuid.uuid4().hex[:8]}"
    assert len(lease_cycles(client, [job])) == 1
    assert client.client_id() != first


def test_threads_sharing_the_kept_connection_each_get_their_own_replies(pool_child) -> None:
    client = redis_state.client()
    prefix = f"job-{uuid.uuid4().hex[:8]}"
    fences: dict[int, list[int]] = {}
    failures: list[BaseException] = []

    def run(n: int) -> None:
        try:
            fences[n] = lease_cycles(client, [f"{prefix}-{n}-{i}" for i in range(200)])
        except BaseException as exc:  # reported below, not lost in the thread
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    assert sorted(fences) == [0, 1, 2, 3]
    assert all(len(found) == 200 for found in fences.values())


def test_a_client_made_before_a_fork_is_not_the_childs(pool_child) -> None:
    parent = redis_state.client()
    parent_id = parent.client_id()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its own client's connection id, then leave
        try:
            child = redis_state.client()
            same = child is parent
            os.write(write, f"{int(same)}|{child.client_id()}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as reply:
        same, child_id = reply.read().split("|")
    os.waitpid(pid, 0)
    assert same == "0"
    assert int(child_id) != parent_id
    assert parent.client_id() == parent_id  # the parent's connection was left alone
