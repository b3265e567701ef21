"""Which version of the code a process runs: where it is read, in order, and what the
check refuses."""

from __future__ import annotations

import pytest

from celery_explicit import app_version
from celery_explicit.conf import Settings


@pytest.fixture(autouse=True)
def no_deploy_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*app_version.ENVIRONMENT, "EXPLICIT_APP_VERSION"):
        monkeypatch.delenv(name, raising=False)


def test_the_setting_comes_first(settings, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("GIT_SHA", "abc123")
    settings.EXPLICIT_APP_VERSION = "2026.12.1"
    assert app_version.source() == ("2026.12.1", "EXPLICIT_APP_VERSION")


def test_the_environment_setting_next(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_SHA", "abc123")
    monkeypatch.setenv("EXPLICIT_APP_VERSION", "from-env")
    assert app_version.source() == ("from-env", "EXPLICIT_APP_VERSION")


def test_then_a_deploy_variable_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K_REVISION", "svc-00042")
    monkeypatch.setenv("GIT_SHA", "  abc123 with a tail\n")
    assert app_version.source() == ("abc123", "$GIT_SHA")


def test_then_the_distribution_holding_the_urlconf(settings) -> None:  # type: ignore[no-untyped-def]
    import importlib.metadata

    settings.ROOT_URLCONF = "celery.app"  # a package an installed distribution holds
    assert app_version.source() == (importlib.metadata.version("celery"), "distribution celery")


def test_unknown_when_nothing_says(settings) -> None:  # type: ignore[no-untyped-def]
    settings.ROOT_URLCONF = "tests.urls"  # the tests' own package: not installed
    assert app_version.source() == ("", "unknown")


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("x" * 65, "at most 64 characters (it has 65)"),
        ("1.2 beta", "printable ASCII with no spaces"),
        ("r\u00e9sum\u00e9", "printable ASCII with no spaces"),
    ],
)
def test_the_check_refuses_a_version_no_row_can_hold(value: str, problem: str) -> None:
    setting = Settings.table()["EXPLICIT_APP_VERSION"]
    [found] = setting.problems(value)
    assert "EXPLICIT_APP_VERSION" in str(found) and problem in str(found)
    assert setting.problems("v1.2.3+build.7") == []


def test_a_process_says_its_version_in_the_metrics(
    settings, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import REGISTRY

    from celery_explicit import records

    settings.EXPLICIT_APP_VERSION = "2026.12.9"
    app_version.current.cache_clear()
    monkeypatch.setattr(records, "_version_announced", False)
    try:
        records._announce_version()
        value = REGISTRY.get_sample_value("explicit_app_version_info", {"version": "2026.12.9"})
        assert value == 1.0
    finally:
        app_version.current.cache_clear()
