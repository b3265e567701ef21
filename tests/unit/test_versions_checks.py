"""The untested-version findings without another Celery installed: ``W005`` from
``manage.py check``, the worker's refusal and its override, and ``--version``'s report.
The installed versions are replaced by ones outside the range (``versions.installed``);
``tests/integration/test_versions_refusal.py`` starts a real worker."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from django.test import override_settings

from celery_explicit import __main__ as cli
from celery_explicit import bootsteps, versions
from django_outbox import checks

UNTESTED = {"celery": "5.8.0", "kombu": "5.8.1"}


@pytest.fixture
def untested(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "installed", lambda: dict(UNTESTED))


def test_check_is_quiet_on_tested_versions() -> None:
    assert checks.check_versions() == []


@pytest.mark.usefixtures("untested")
def test_check_warns_that_a_worker_will_refuse_untested_versions() -> None:
    [found] = checks.check_versions()
    assert found.id == "django_outbox.W005"
    assert "Celery 5.8.0 (untested)" in found.msg and "kombu 5.8.1 (untested)" in found.msg
    assert "a worker will refuse to start" in found.msg
    assert found.hint is not None and "EXPLICIT_ALLOW_UNTESTED_VERSIONS" in found.hint


@pytest.mark.usefixtures("untested")
@override_settings(EXPLICIT_ALLOW_UNTESTED_VERSIONS=True)
def test_check_warns_about_the_override_while_it_is_used() -> None:
    [found] = checks.check_versions()
    assert found.id == "django_outbox.W005"
    assert "workers start anyway because EXPLICIT_ALLOW_UNTESTED_VERSIONS is set" in found.msg


class _App:
    """An app our steps were installed on (a WeakSet member: no Celery app needed)."""


def _worker_of_an_installed_app() -> Any:
    app = _App()
    bootsteps._installed.add(app)
    return SimpleNamespace(app=app)  # holds the app while the test runs


@pytest.mark.usefixtures("untested")
def test_worker_refuses_untested_versions_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        bootsteps.refuse_untested_versions(sender=_worker_of_an_installed_app())
    assert exited.value.code == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("worker refuses to start: celery-explicit ")
    assert "Celery >=5.7,<5.8 and kombu >=5.7,<5.8" in line
    assert "installed: Celery 5.8.0 (untested) and kombu 5.8.1 (untested)" in line
    assert "EXPLICIT_ALLOW_UNTESTED_VERSIONS = True" in line


@pytest.mark.usefixtures("untested")
@override_settings(EXPLICIT_ALLOW_UNTESTED_VERSIONS=True)
def test_the_override_lets_the_worker_start(capsys: pytest.CaptureFixture[str]) -> None:
    bootsteps.refuse_untested_versions(sender=_worker_of_an_installed_app())  # no exit
    assert "refuses" not in capsys.readouterr().err


def test_worker_starts_on_tested_versions() -> None:
    assert bootsteps.refuse_untested_versions(sender=_worker_of_an_installed_app()) is None


@pytest.mark.usefixtures("untested")
def test_version_report_flags_untested_versions_and_exits_non_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Port 1 refuses at once: the report says so instead of failing.
    assert cli.main(["--version", "--redis-url", "redis://127.0.0.1:1/0"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"celery-explicit {versions.__version__}"
    assert "Celery 5.8.0 (UNTESTED, outside >=5.7,<5.8: a worker refuses it)" in out
    assert "kombu 5.8.1 (UNTESTED, outside >=5.7,<5.8: a worker refuses it)" in out
    assert out[-1].startswith("Redis at redis://127.0.0.1:1/0 (--redis-url): Redis not reachable")


def test_version_report_hides_a_password() -> None:
    assert cli._without_password("redis://u:secret@h:6380/1") == "redis://u:***@h:6380/1"
    assert cli._without_password("redis://h:6380/1") == "redis://h:6380/1"
