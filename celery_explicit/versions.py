"""The package's version, and the Celery and kombu versions it is tested with.

One place for both. ``pyproject.toml`` reads ``__version__`` from here (setuptools'
``attr:``, read without importing the package), and its ``celery`` and ``kombu``
dependency ranges must say what ``TESTED`` says (``tests/unit/test_versions_ranges.py``
compares them): the ranges are what the matrix (``noxfile.py``, docs/compatibility.md)
passed, nothing wider.

A worker refuses to start on a Celery or kombu outside ``TESTED``
(``celery_explicit.bootsteps``): our bootsteps wrap Celery internals
(``Consumer.on_decode_error``, ``create_task_handler``, ``worker.state``) that a
minor release may rename; an untested pair fails in production, not at start-up.
``EXPLICIT_ALLOW_UNTESTED_VERSIONS`` overrides it, and ``manage.py check`` says so
(``django_outbox.W005``).

The checks take the versions as arguments, so they are tested without installing
another Celery.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__version__ = "0.1.0.dev0"

# The release numbers, then anything after them ("rc1", ".dev0", ".post1", "+local").
_VERSION = re.compile(r"^\s*v?(\d+(?:\.\d+)*)(.*)$")
# A suffix that makes it a pre-release or development release, before its release.
_PRE = re.compile(r"^[-_.]?(a|b|c|rc|alpha|beta|pre|preview|dev)\d*", re.IGNORECASE)


def _release(version: str) -> tuple[tuple[int, ...], bool]:
    """``"5.7.0rc1"`` -> ``((5, 7, 0), True)``: the release numbers, and whether it is
    a pre-release. Raises ValueError on a version without numbers."""
    match = _VERSION.match(version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    numbers = tuple(int(part) for part in match.group(1).split("."))
    return numbers, bool(_PRE.match(match.group(2)))


def _padded(numbers: tuple[int, ...], width: int) -> tuple[int, ...]:
    return numbers + (0,) * (width - len(numbers))


@dataclass(frozen=True)
class Range:
    """``>=floor,<ceiling``, the way pip reads it: a pre-release of the floor
    (``5.7.0rc1``) is below it, and one of the ceiling (``5.8.0rc1``) is outside too."""

    floor: str
    ceiling: str

    def __contains__(self, version: object) -> bool:
        if not isinstance(version, str):
            return False
        try:
            numbers, pre = _release(version)
        except ValueError:
            return False
        floor, _ = _release(self.floor)
        ceiling, _ = _release(self.ceiling)
        width = max(len(numbers), len(floor), len(ceiling))
        numbers, floor, ceiling = (_padded(n, width) for n in (numbers, floor, ceiling))
        above_floor = numbers > floor or (numbers == floor and not pre)
        return above_floor and numbers < ceiling

    def __str__(self) -> str:
        return f">={self.floor},<{self.ceiling}"


#: What the matrix passed (docs/compatibility.md); pyproject.toml declares the same.
TESTED: Mapping[str, Range] = {
    "celery": Range("5.7", "5.8"),
    "kombu": Range("5.7", "5.8"),
}

#: How each distribution is named in messages.
_LABEL = {"celery": "Celery", "kombu": "kombu"}


def installed() -> dict[str, str]:
    """The Celery and kombu this process imported (not what pip's metadata says: a
    vendored or path-installed copy is what runs)."""
    import celery
    import kombu

    # celery-types' stubs for kombu leave out ``__version__``; kombu has it at runtime.
    kombu_version = kombu.__version__  # type: ignore[attr-defined]
    return {"celery": str(celery.__version__), "kombu": str(kombu_version)}


def untested(
    versions: Mapping[str, str], *, tested: Mapping[str, Range] | None = None
) -> list[str]:
    """The names in ``versions`` whose version is outside its tested range."""
    ranges = TESTED if tested is None else tested
    return [name for name, rng in ranges.items() if versions.get(name, "") not in rng]


def untested_line(
    versions: Mapping[str, str], *, tested: Mapping[str, Range] | None = None
) -> str | None:
    """One line naming both installed versions and the tested ranges, when one of them
    is outside its range; None when both are tested."""
    ranges = TESTED if tested is None else tested
    outside = untested(versions, tested=ranges)
    if not outside:
        return None
    have = " and ".join(
        f"{_LABEL.get(name, name)} {versions.get(name, '(not installed)')}"
        + (" (untested)" if name in outside else "")
        for name in ranges
    )
    wanted = " and ".join(f"{_LABEL.get(name, name)} {rng}" for name, rng in ranges.items())
    return f"celery-explicit {__version__} is tested with {wanted}; installed: {have}"
