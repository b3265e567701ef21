"""The fast binding of a call's arguments agrees with ``inspect.Signature.bind``: the
same two dicts in the same order, and None wherever ``inspect`` would refuse the call
or the signature is not plain (the caller then binds, or refuses, through inspect)."""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import pytest

from celery_explicit.arguments import INSPECT_ONLY, Binder


def by_inspect(
    sig: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """What ExplicitTask.bind_arguments computed through inspect alone."""
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return None
    given = dict(bound.arguments)
    bound.apply_defaults()
    return dict(bound.arguments), given


def f_two(order_id, line): ...  # type: ignore[no-untyped-def]
def f_default(order_id, line=1, *, note="", when=None): ...  # type: ignore[no-untyped-def]
def f_kwonly(*, order_id, amount=0): ...  # type: ignore[no-untyped-def]
def f_none(): ...  # type: ignore[no-untyped-def]
def f_varargs(order_id, *rest): ...  # type: ignore[no-untyped-def]
def f_varkw(order_id, **extra): ...  # type: ignore[no-untyped-def]
def f_posonly(order_id, /, line): ...  # type: ignore[no-untyped-def]


PLAIN = [f_two, f_default, f_kwonly, f_none]
NOT_PLAIN = [f_varargs, f_varkw, f_posonly]
NAMES = ["order_id", "line", "note", "when", "amount", "other"]


def calls() -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Every mix of 0-3 positional arguments with every subset (in two orders) of
    keyword names, the known ones and an unknown one."""
    found = []
    for n in range(4):
        args = tuple(f"p{i}" for i in range(n))
        for size in range(4):
            for names in itertools.combinations(NAMES, size):
                for ordered in {names, tuple(reversed(names))}:
                    found.append((args, {name: f"k-{name}" for name in ordered}))
    return found


@pytest.mark.parametrize("func", PLAIN, ids=lambda f: f.__name__)
def test_a_plain_signature_binds_as_inspect_binds(func: Any) -> None:
    sig = inspect.signature(func)
    binder = Binder.of(sig)
    assert binder.names is not None
    fast_paths = refused = 0
    for args, kwargs in calls():
        expected = by_inspect(sig, args, kwargs)
        got = binder.bind(args, kwargs)
        if expected is None:
            assert got is None, (args, kwargs, got)
            refused += 1
            continue
        assert got is not None, (args, kwargs)
        # Same values, same order (the fingerprint sorts, but the key's format and the
        # attempt row's arguments read them in order).
        assert list(got[0].items()) == list(expected[0].items()), (args, kwargs)
        assert list(got[1].items()) == list(expected[1].items()), (args, kwargs)
        # Defaults are the signature's own objects, as apply_defaults gives them.
        for name, value in got[0].items():
            if name not in got[1]:
                assert value is sig.parameters[name].default
        fast_paths += 1
    # The sample exercises both outcomes for every signature.
    assert fast_paths and refused, (fast_paths, refused)


@pytest.mark.parametrize("func", NOT_PLAIN, ids=lambda f: f.__name__)
def test_any_other_signature_is_left_to_inspect(func: Any) -> None:
    binder = Binder.of(inspect.signature(func))
    assert binder.names is None
    assert all(binder.bind(args, kwargs) is None for args, kwargs in calls())


def test_the_default_binder_binds_nothing() -> None:
    assert INSPECT_ONLY.bind((), {}) is None


def test_the_dicts_returned_are_the_callers_own() -> None:
    binder = Binder.of(inspect.signature(f_default))
    first = binder.bind((1,), {})
    assert first is not None
    first[0]["line"] = 99
    first[1]["order_id"] = 99
    again = binder.bind((1,), {})
    assert again == ({"order_id": 1, "line": 1, "note": "", "when": None}, {"order_id": 1})
    assert binder.defaults["line"] == 1
