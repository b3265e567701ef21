"""A holder's process is alive only while it runs: a zombie (exited, not yet reaped by
its parent) still has its /proc entry, and must count as gone (a takeover
waited about 3 s for the pool to reap a killed child)."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator

import pytest

from celery_explicit import execution_lease
from celery_explicit.message_lease import child_is_stopped


@pytest.fixture
def zombie() -> Iterator[int]:
    """A child that has exited and that this process has not reaped yet."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 5
    while execution_lease.process_state(pid) != b"Z":
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    yield pid
    with contextlib.suppress(ChildProcessError):  # already reaped by the test
        os.waitpid(pid, 0)


def test_a_zombie_is_gone_and_its_holder_dead(zombie: int) -> None:
    assert os.path.exists(f"/proc/{zombie}")  # what the old check looked at
    assert execution_lease.process_is_gone(zombie)
    assert execution_lease._holder_is_dead(f"{socket.gethostname()}:{zombie}")
    assert not child_is_stopped(zombie)


def test_a_live_process_is_not_gone() -> None:
    assert execution_lease.process_state(os.getpid()) in (b"R", b"S")
    assert not execution_lease.process_is_gone(os.getpid())
    assert not execution_lease._holder_is_dead(f"{socket.gethostname()}:{os.getpid()}")


def test_a_reaped_process_is_gone(zombie: int) -> None:
    os.waitpid(zombie, 0)
    assert execution_lease.process_state(zombie) is None
    assert execution_lease.process_is_gone(zombie)


def test_another_host_s_holder_is_never_judged_here() -> None:
    assert not execution_lease._holder_is_dead("elsewhere.example:1")
