"""The README's demo runs end to end (SQLite, a real worker) and shows each contract."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.worker


@pytest.mark.timeout(300)  # two workers and two 6 s incident jobs, on a loaded machine
def test_demo_shows_each_contract(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "SHOP_STATE_DIR": str(tmp_path),
        "PYTHONPATH": f"{ROOT / 'example_project'}{os.pathsep}{ROOT}",
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    # Its own process group: if it fails or times out, its workers are stopped with it
    # instead of consuming from the shared Redis during the next tests.
    demo = subprocess.Popen(
        [sys.executable, "manage.py", "demo"],
        cwd=ROOT / "example_project",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = demo.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(demo.pid, signal.SIGKILL)
        demo.wait()
    assert demo.returncode == 0, err[-3000:]
    assert "money moved 1 time(s)" in out
    assert out.count(": already_applied") == 1
    before_lock = out.split("\n8. ")[0]
    assert before_lock.count("retry_scheduled, next try in") == 2
    assert "synced quantity: 12" in out
    assert "reason=permanent attempts=1 key=invoice:1:send_email" in out
    assert "status=failed_permanent" in out
    # The ShipOrder incident, with and without the lease heartbeat: shipped once both
    # times; without it a second execution ran and the first one's commit was fenced.
    assert (
        "with the lease heartbeat: 1 execution(s), 0 redelivered; warehouse asked to ship 1 time(s)"
    ) in out
    # Without the heartbeat each delivery's lease runs out T after it: the job (longer
    # than T) is delivered again, once or more, and every stale commit is fenced.
    without = re.search(
        r"without it \(what Celery alone does\): (\d+) execution\(s\), (\d+) redelivered; "
        r"warehouse asked to ship 1 time\(s\)",
        out,
    )
    assert without, out
    runs, redelivered = int(without.group(1)), int(without.group(2))
    assert runs >= 2 and redelivered == runs - 1
    assert len(re.findall(r": fenced( \(redelivered\))? - ", out)) == runs - 1
    assert "ran in this order: 1, 2, 3, 4" in out
    assert "status=delivered (event 4)" in out
    # Read through the versioned cache before and after the events: the bumps after
    # each commit reached the reader.
    assert "cached status: placed (v0) before, delivered (v4) after; stale reads seen: False" in out
    assert "the resend was dropped at publish (it returned the same job: True)" in out
    assert "outbox rows: 1 (the rolled-back one left none)" in out
    assert re.search(r"order \d+: shipped 1 time\(s\); order \d+ \(rolled back\): shipped 0", out)
    # Nine labels of one courier at 3 a second: three start at once, the rest are
    # deferred to starts booked a third of a second apart; the other courier's label is
    # not held behind them.
    labels = re.search(r"dhl labels started at ([^;]+) s; deferred (\d+) times", out)
    assert labels, out
    starts = [float(t) for t in labels.group(1).replace("+", "").split(", ")]
    assert len(starts) == 9
    # (A start is stamped before the admission; load only makes the fourth later.)
    assert sum(t < 0.5 for t in starts) <= 3, starts
    assert starts[-1] >= 1.5, starts
    assert int(labels.group(2)) >= 6
    ups = re.search(r"ups label started ([\d.]+) s after its publish, deferred 0 times", out)
    assert ups, out
    assert float(ups.group(1)) < starts[-1], (ups.group(1), starts)
    # Two beats at once: every slot published by one of them, the other's copy dropped
    # and recorded, each slot's payouts settled once.
    beats = re.search(
        r"slots published: (\d+), by \d beat\(s\); copies the other beat dropped: (\d+)", out
    )
    assert beats, out
    published, dropped = int(beats.group(1)), int(beats.group(2))
    assert published >= 2 and dropped >= 1, beats.group(0)
    settled = re.search(r"payouts settled: (\d+), (\d+) slot\(s\), each once", out)
    assert settled, out
    # Once per slot; a slot can be settled without its row if a beat stops between
    # publishing it and recording it (the demo stops them halfway between slots).
    assert int(settled.group(1)) == int(settled.group(2)) >= published, settled.group(0)
    # The demo ends by explaining the incident from the stored data.
    explained = out.split("\n11. manage.py explicit_explain ")[1]
    verdict = next(line for line in explained.splitlines() if "verdict:" in line)
    assert "effect applied once at" in verdict
    assert f"ran {runs} times" in verdict
    fenced = runs - 1
    assert f"{fenced} stale commit{'s' if fenced > 1 else ''} fenced" in verdict
    assert "lease takeover" in verdict
    # Two rebuilds of one report: the lease lock kept them apart (the second waited in
    # retries, each naming the lock error), and each write carried a larger token.
    lock_part = out.split("\n8. ")[1]
    assert "rebuilds overlapped: False" in lock_part
    assert re.search(r"retry_scheduled, next try in [\d.]+s \(LockNotAcquired\)", lock_part)
    tokens = re.search(r"fencing tokens in order: (\d+) then (\d+)", lock_part)
    assert tokens and int(tokens.group(2)) > int(tokens.group(1))
    assert re.search(
        rf"rebuilt 2 time\(s\), total 4599 cents, written last with token "
        rf"{tokens.group(2)}\b",
        lock_part,
    )


@pytest.mark.parametrize(("steps", "named"), [("1,12", "12"), ("", ""), ("1,,2", ""), ("²", "²")])
def test_demo_refuses_a_step_it_does_not_have(tmp_path: Path, steps: str, named: str) -> None:
    env = {
        **os.environ,
        "SHOP_STATE_DIR": str(tmp_path),
        "PYTHONPATH": f"{ROOT / 'example_project'}{os.pathsep}{ROOT}",
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run(
        [sys.executable, "manage.py", "demo", "--steps", steps],
        cwd=ROOT / "example_project",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done
    assert f"--steps: {named!r} is not a step; the steps are 1 to 11" in done.stderr, done.stderr
