"""Lease lock operations per second against the same raw redis-py round trips, and
against redis-py's Lock. The targets (P4 in docs/performance.md):

- P4a, acquire + extend + release of a ``LeaseLock`` (owner token, fencing counter,
  three Lua scripts) vs the same number of raw round trips (SET NX PX, PEXPIRE, DEL):
  >= 0.9;
- P4b, acquire + release of a ``LeaseLock`` vs ``redis.lock.Lock`` acquire + release:
  >= 1.0.

P4a's ceiling, in the same rounds: the least a lock with a fencing token sends, by
hand, no code of ours: three ``EVALSHA`` calls of the smallest scripts that keep it
safe (``SET NX PX`` with the fence's ``INCR``; ``PEXPIRE`` and ``DEL`` each only if
the token still owns the key). Taking the fence and checking the owner atomically needs
a script (a ``MULTI`` cannot make its ``INCR`` depend on the ``SET``), and a script
costs Redis more than a plain command does; that ceiling against the raw three is
what P4a could read with our Python at zero.

Between the two, a third side: our own lock functions called by hand (``FCALL``, the
same keys and arguments, no ``LeaseLock``), so "ours / our functions" is what our
Python costs and "our functions / the smallest scripts" what our Lua costs Redis.

Against the Redis at 127.0.0.1:6379 (db 14). Each round runs every side in chunks of
CHUNK operations, taking turns (the order reversed every other chunk), so a machine
that slows down or speeds up within a round weighs on every side alike.

    scripts/bench lock_round_trips.py [--ops 3000] [--rounds 5]
    make bench-p4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from bench.common import ratio_line
from celery_explicit.locks import ACQUIRE, EXTEND, RELEASE, LeaseLock
from celery_explicit.redis_scripts import library

CHUNK = 100


def rates(sides: dict[str, Callable[[], Any]], ops: int) -> dict[str, float]:
    """Operations a second of each side, run in turns of CHUNK operations."""
    spent = dict.fromkeys(sides, 0.0)
    order = list(sides.items())
    chunks = max(1, ops // CHUNK)
    for _ in range(chunks):
        for name, fn in order:
            start = time.perf_counter()
            for _ in range(CHUNK):
                fn()
            spent[name] += time.perf_counter() - start
        order.reverse()
    return {name: chunks * CHUNK / spent[name] for name in sides}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    client = redis.Redis.from_url("redis://127.0.0.1:6379/14")
    prefix = f"bench-p4:{uuid.uuid4().hex[:6]}:"
    ours = LeaseLock(client, "rebuild:user:1", ttl=30, prefix=prefix)
    theirs = client.lock(f"{prefix}redis-py-lock", timeout=30)
    raw_key = f"{prefix}raw"

    def ours_full() -> None:
        ours.acquire()
        ours.extend()
        ours.release()

    def raw_three() -> None:
        client.set(raw_key, "token", nx=True, px=30000)
        client.pexpire(raw_key, 30000)
        client.delete(raw_key)

    # The smallest scripts of a fenced lock (see the module's docstring).
    acquire_sha, extend_sha, release_sha = (
        client.script_load(source)
        for source in (
            "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then "
            "return redis.call('INCR', KEYS[2]) end return 0",
            "if redis.call('GET', KEYS[1]) == ARGV[1] then "
            "return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0",
            "if redis.call('GET', KEYS[1]) == ARGV[1] then "
            "return redis.call('DEL', KEYS[1]) end return 0",
        )
    )
    script_key, fence_key = f"{prefix}scripts", f"{prefix}scripts-fence"

    def scripts_three() -> None:
        assert client.execute_command(
            "EVALSHA", acquire_sha, 2, script_key, fence_key, "token", 30000
        )
        assert client.execute_command("EVALSHA", extend_sha, 1, script_key, "token", 30000)
        assert client.execute_command("EVALSHA", release_sha, 1, script_key, "token")

    # Our own three functions, by hand: what LeaseLock sends, none of its Python. Redis 7
    # functions only (LeaseLock itself falls back to EVALSHA on Redis 6; this side does not).
    ours_acquire, ours_extend, ours_release = (
        library().function_names[script.name] for script in (ACQUIRE, EXTEND, RELEASE)
    )
    by_hand_key, by_hand_fence = f"{prefix}lock:{{by-hand}}", f"{prefix}fence:{{by-hand}}"
    owner = ours.owner

    def our_functions() -> None:
        token = os.urandom(16).hex()  # as LeaseLock draws it and writes its value
        assert client.execute_command(
            "FCALL", ours_acquire, 2, by_hand_key, by_hand_fence,
            f"{token}|0|{int(time.time() * 1000)}|{owner}", 30000,
        )  # fmt: skip
        assert client.execute_command(
            "FCALL", ours_extend, 2, by_hand_key, by_hand_fence, token, 30000
        )
        assert client.execute_command("FCALL", ours_release, 1, by_hand_key, token)

    def ours_pair() -> None:
        ours.acquire()
        ours.release()

    def theirs_pair() -> None:
        theirs.acquire()
        theirs.release()

    full_sides = {
        "ours_full": ours_full,
        "our_functions": our_functions,
        "scripts_three": scripts_three,
        "raw_three": raw_three,
    }
    pair_sides = {"ours_pair": ours_pair, "theirs_pair": theirs_pair}
    rates({**full_sides, **pair_sides}, 300)  # warm-up: library loaded, connections open
    results: dict[str, list[float]] = {k: [] for k in {**full_sides, **pair_sides}}
    for _ in range(args.rounds):
        for sides in (full_sides, pair_sides):
            for name, value in rates(sides, args.ops).items():
                results[name].append(value)
    for name, values in results.items():
        print(
            f"{name:<13} median {statistics.median(values):9.1f}/s  "
            f"min {min(values):9.1f}/s  max {max(values):9.1f}/s"
        )
    full = [o / r for o, r in zip(results["ours_full"], results["raw_three"], strict=True)]
    ceiling = [c / r for c, r in zip(results["scripts_three"], results["raw_three"], strict=True)]
    pair = [o / t for o, t in zip(results["ours_pair"], results["theirs_pair"], strict=True)]
    over_scripts = [
        o / c for o, c in zip(results["ours_full"], results["scripts_three"], strict=True)
    ]
    python = [o / f for o, f in zip(results["ours_full"], results["our_functions"], strict=True)]
    lua = [f / c for f, c in zip(results["our_functions"], results["scripts_three"], strict=True)]
    for label, ratios, note in (
        ("P4a acquire+extend+release / 3 raw round trips", full, "target >= 0.9"),
        ("P4a's ceiling, the three smallest scripts of a fenced lock / 3 raw", ceiling, ""),
        ("  ours / those scripts", over_scripts, ""),
        ("  ours / our functions by hand", python, "our Python"),
        ("  our functions by hand / those scripts", lua, "our Lua"),
    ):
        print(ratio_line(label, ratios, note))
    print(
        f"P4b acquire+release / redis-py Lock: median {statistics.median(pair):.3f} (target >= 1.0)"
    )
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)


if __name__ == "__main__":
    main()
