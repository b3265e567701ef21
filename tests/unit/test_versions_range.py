"""The tested ranges: how a version is judged, the one line a worker prints, and that
pyproject.toml declares what ``celery_explicit.versions`` checks (one place each)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from celery_explicit import versions
from celery_explicit.versions import Range

ROOT = Path(__file__).resolve().parents[2]
RANGE = Range("5.7", "5.8")


@pytest.mark.parametrize(
    "version",
    ["5.7", "5.7.0", "5.7.1", "5.7.12", "5.7.0.post1", "5.7.3+local", "5.7.99rc1"],
)
def test_a_version_inside_the_range_is_tested(version: str) -> None:
    assert version in RANGE


@pytest.mark.parametrize(
    "version",
    # A pre-release of the floor is below it and one of the ceiling is outside, as pip
    # reads ">=5.7,<5.8"; junk is never tested.
    ["5.6.3", "5.7.0rc1", "5.7.0.dev0", "5.8", "5.8.0", "5.8.0rc1", "6.0", "4.4.7", "", "x"],
)
def test_a_version_outside_the_range_is_untested(version: str) -> None:
    assert version not in RANGE


def test_the_line_names_both_installed_versions_and_the_ranges() -> None:
    tested = {"celery": RANGE, "kombu": RANGE}
    line = versions.untested_line({"celery": "5.8.0", "kombu": "5.7.0"}, tested=tested)
    assert line == (
        f"celery-explicit {versions.__version__} is tested with Celery >=5.7,<5.8 and "
        "kombu >=5.7,<5.8; installed: Celery 5.8.0 (untested) and kombu 5.7.0"
    )
    assert "\n" not in line


def test_kombu_alone_outside_is_named_too() -> None:
    tested = {"celery": RANGE, "kombu": RANGE}
    assert versions.untested({"celery": "5.7.0", "kombu": "5.6.2"}, tested=tested) == ["kombu"]
    line = versions.untested_line({"celery": "5.7.0", "kombu": "5.6.2"}, tested=tested)
    assert line is not None and "kombu 5.6.2 (untested)" in line


def test_tested_versions_give_no_line() -> None:
    tested = {"celery": RANGE, "kombu": RANGE}
    assert versions.untested_line({"celery": "5.7.0", "kombu": "5.7.0"}, tested=tested) is None


def test_a_missing_distribution_is_untested() -> None:
    line = versions.untested_line({"celery": "5.7.0"}, tested={"celery": RANGE, "kombu": RANGE})
    assert line is not None and "kombu (not installed) (untested)" in line


def test_this_environment_is_in_the_tested_range() -> None:
    """The suite runs on what the package declares; a failure here means the matrix or
    the venv drifted from pyproject.toml."""
    assert versions.untested(versions.installed()) == []


def _declared(requirement: str) -> tuple[str, str]:
    match = re.fullmatch(r"([a-z]+)(?:\[[a-z,]+\])?>=([\d.]+),<([\d.]+)", requirement)
    assert match, requirement
    return match.group(1), f">={match.group(2)},<{match.group(3)}"


def test_pyproject_declares_exactly_the_tested_ranges() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = dict(
        _declared(req) for req in project["dependencies"] if req.startswith(("celery", "kombu"))
    )
    assert declared == {name: str(rng) for name, rng in versions.TESTED.items()}


def test_the_version_has_one_place() -> None:
    """pyproject.toml reads it from celery_explicit/versions.py; it declares none."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    dynamic = pyproject["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "celery_explicit.versions.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.dev\d+)?", versions.__version__)
