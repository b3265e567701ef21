"""A lease-lock holder paused (SIGSTOP, a real process) past its TTL while another
takes the lock over and writes, many times.

Must hold: every stale write refused; the fencing tokens the row accepted only grow.
Negative control: without the token check (a plain update) the stale write lands.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from django.db import connection

from celery_explicit import redis_state
from celery_explicit.locks import LeaseLock
from django_outbox.store.guarded_writes import fenced_update
from tests.chaos.report import Row, scaled
from tests.support.processes import ROOT, project_env
from tests.testapp.models import Profile

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(scaled(120, 900))]

ROUNDS = scaled(20, 200)
TTL = 0.2


def rounds(fenced: bool, first_user: int) -> dict[str, object]:
    prefix = f"explicit-chaos:{uuid.uuid4().hex[:8]}:"
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.chaos.lock_holder", prefix, "1" if fenced else "0"],
        cwd=ROOT,
        env=project_env(db_name=connection.settings_dict["NAME"], queue="unused"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    assert holder.stdout.readline().strip() == "ready"
    refused = landed = 0
    accepted: list[int] = []
    try:
        for user_id in range(first_user, first_user + ROUNDS):
            Profile.objects.create(user_id=user_id, data="initial")
            holder.stdin.write(f"acquire {user_id} {TTL}\n")
            holder.stdin.flush()
            stale_token = int(holder.stdout.readline().split()[1])
            os.kill(holder.pid, signal.SIGSTOP)  # paused while it holds the lock
            try:
                time.sleep(TTL * 1.5)  # past its TTL
                newer = LeaseLock(
                    redis_state.client(), f"profile:{user_id}", ttl=5.0, prefix=prefix
                )
                token = newer.acquire(wait=2.0)
                assert token > stale_token
                rows = Profile.objects.filter(user_id=user_id)
                if fenced:
                    fenced_update(rows, token=token, data="newer")
                else:
                    rows.update(data="newer", fencing_token=token)
                accepted.append(token)
                newer.release()
            finally:
                os.kill(holder.pid, signal.SIGCONT)
            holder.stdin.write(f"write {user_id}\n")
            holder.stdin.flush()
            answer = holder.stdout.readline().split()
            if answer[0] == "refused":
                refused += 1
            else:
                accepted.append(int(answer[1]))
                landed += Profile.objects.get(user_id=user_id).data == "stale"
    finally:
        holder.kill()
        holder.communicate()  # closes its pipes
    grows = all(b > a for a, b in itertools.pairwise(accepted))
    return {"refused": refused, "landed": landed, "tokens_grow": grows}


def test_paused_lock_holder() -> None:
    started = time.monotonic()
    result = rounds(True, 0)
    control = rounds(False, 100_000)
    row = Row(
        scenario="paused lock holder",
        fault="a lease-lock holder stopped (SIGSTOP) past its TTL; another takes over",
        faults=ROUNDS,
        jobs=ROUNDS,
        lost=0,
        duplicates=0,
        figures={
            "stale writes refused": f"{result['refused']}/{ROUNDS}",
            "accepted tokens only grow": result["tokens_grow"],
        },
        holds=result["refused"] == ROUNDS and result["landed"] == 0 and result["tokens_grow"],
        control=f"no token check: {control['landed']}/{ROUNDS} stale writes landed",
        control_failed=control["landed"] > 0,
        seconds=round(time.monotonic() - started, 1),
    )
    row.save()
    assert row.ok, row
