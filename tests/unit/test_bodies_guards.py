"""Guards against message bodies and headers nobody expected (the chaos scenario
tests/chaos/test_unexpected_bodies.py finds them end to end; these pin each guard alone)."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest
from celery.exceptions import InvalidTaskError

from celery_explicit.bootsteps import RefuseMisshapen, _too_deep
from celery_explicit.message_lease_transport import _append_with_lease
from celery_explicit.request import MAX_NESTING, _wrong_embed, nested_deeper_than


def nest(depth: int, leaf: Any = 0, *, kind: type = list) -> Any:
    """``depth`` levels of lists (or dicts), built without recursion."""
    value = leaf
    for _ in range(depth):
        value = [value] if kind is list else {"k": value}
    return value


# --- nesting depth ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [list, dict])
def test_depth_bound_is_exact(kind: type) -> None:
    assert not nested_deeper_than(nest(MAX_NESTING, kind=kind))
    assert nested_deeper_than(nest(MAX_NESTING + 1, kind=kind))


def test_scalars_and_flat_values_are_not_deep() -> None:
    for value in (None, 0, "x" * 1000, b"\xff", [], {}, [1, 2, 3], {"a": [1], "b": {}}):
        assert not nested_deeper_than(value, 2)
    assert nested_deeper_than([[[]]], 2)
    assert not nested_deeper_than([[1]], 2)  # a leaf inside level 2 is no level 3


def test_depth_past_the_recursion_limit_is_measured_without_recursion() -> None:
    deep = nest(sys.getrecursionlimit() * 5)
    assert nested_deeper_than(deep)
    assert nested_deeper_than(deep, sys.getrecursionlimit() * 4)
    assert not nested_deeper_than(deep, sys.getrecursionlimit() * 5)


def test_a_deep_branch_beside_shallow_ones_is_found() -> None:
    body = [[], {"run": "r", "job": 1, "blob": [1, 2, nest(MAX_NESTING)]}, {"chain": None}]
    assert nested_deeper_than(body)
    body[1]["blob"] = [1, 2, nest(MAX_NESTING - 4)]  # type: ignore[index]
    assert not nested_deeper_than(body)


def test_a_usual_message_is_not_deep() -> None:
    headers = {"task": "chaos.job", "id": "x", "timelimit": [None, None], "stamps": {}}
    body = [[], {"run": "r", "job": 1}, {"callbacks": None, "errbacks": None}]
    assert not nested_deeper_than(headers)
    assert not nested_deeper_than(body)


class FakeMessage:
    def __init__(self, headers: Any, payload: Any = None, *, undecodable: bool = False):
        self.headers = headers
        self._payload = payload
        self._undecodable = undecodable
        self.acknowledged = False

    @property
    def payload(self) -> Any:
        if self._undecodable:
            raise ValueError("does not decode")
        return self._payload


def test_too_deep_names_headers_or_body() -> None:
    assert _too_deep(FakeMessage({"task": "t"}, [[], {}, {}])) is None
    why = _too_deep(FakeMessage({"task": "t"}, [[nest(600)], {}, {}]))
    assert why and "body" in why and f"deeper than {MAX_NESTING}" in why and "task t" in why
    why = _too_deep(FakeMessage({"task": "t", "argsrepr": nest(300)}, [[], {}, {}]))
    assert why and "headers" in why
    # Not a dict, no task name, a body that does not decode: left to Celery's handler.
    assert _too_deep(FakeMessage(None, nest(300))) is not None
    assert _too_deep(FakeMessage({}, None, undecodable=True)) is None


def test_refuse_misshapen_refuses_a_deep_message_before_celery_reads_it() -> None:
    handled: list[Any] = []
    refused: list[tuple[Any, Any]] = []

    class Parent:
        def create_task_handler(self) -> Any:
            return handled.append

        def on_invalid_task(self, body: Any, message: Any, exc: Any) -> None:
            refused.append((message, exc))

    parent = Parent()
    RefuseMisshapen(parent)
    on_task_received = parent.create_task_handler()
    usual = FakeMessage({"task": "t"}, [[], {}, {}])
    deep = FakeMessage({"task": "t"}, [[], {"blob": nest(500)}, {}])
    on_task_received(usual)
    on_task_received(deep)
    assert handled == [usual]
    assert [message for message, _ in refused] == [deep]
    assert isinstance(refused[0][1], InvalidTaskError)
    assert f"nested deeper than {MAX_NESTING}" in str(refused[0][1])


# --- embed --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "embed",
    [None, {}, [], 0, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}],
)
def test_usual_or_empty_embed_passes(embed: Any) -> None:
    assert _wrong_embed([[], {}, embed]) is None
    assert _wrong_embed([[], {}, {"callbacks": [{"task": "t"}], "chord": {"task": "c"}}]) is None


@pytest.mark.parametrize(
    "embed",
    [[1], "x", 5, {"errbacks": 5}, {"callbacks": ["t"]}, {"chain": {"task": "t"}}, {"chord": [1]}],
)
def test_wrong_embed_is_named(embed: Any) -> None:
    assert _wrong_embed([[], {}, embed])


# --- the lease's task header --------------------------------------------------------------


class FakeQoS:
    """Stands for kombu's Redis QoS: its own ``append`` records the call."""

    visibility_timeout = 3600

    def __init__(self) -> None:
        self.explicit_leases = {"chaos.job": 30.0}
        self.explicit_holder = ""  # as lease_on_delivery sets them, no holder recorded
        self.explicit_copies: dict[str, int] = {}
        # A channel whose last fetch was kombu's own BRPOP: nothing recorded it yet.
        self.channel = SimpleNamespace(explicit_fetched=False)
        self.kombu_appended: list[tuple[Any, str]] = []

    def append(self, message: Any, delivery_tag: str) -> None:
        self.kombu_appended.append((message, delivery_tag))


class HeaderMessage:
    def __init__(self, headers: Any) -> None:
        self.headers = headers


@pytest.mark.parametrize(
    "headers",
    [
        {"task": ["chaos.job"]},  # unhashable: TypeError in the lookup before the guard
        {"task": {"chaos.job": 1}},
        {"task": None},
        {"task": 7},
        {"task": "other.task"},
        {},
        None,
        ["task", "chaos.job"],  # headers that are not a dict
    ],
)
def test_a_task_header_that_is_no_leased_name_goes_through_kombu(headers: Any) -> None:
    qos = FakeQoS()
    message = HeaderMessage(headers)
    _append_with_lease(qos, message, "tag-1")
    assert qos.kombu_appended == [(message, "tag-1")]


# --- the dead letter's id -----------------------------------------------------------------


def test_only_a_str_or_an_integer_id_names_a_dead_letter() -> None:
    from django_outbox.store.dead_letters import id_text as _id_text

    assert _id_text("bodies-x-1") == "bodies-x-1"
    assert _id_text(10**12 + 5) == str(10**12 + 5)
    # These name no message: as text, every message with the id {} would update one
    # dead letter and the others would vanish.
    for value in ({}, [], [1], True, None, 1.5):
        assert _id_text(value) is None


# --- stamps -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_dict",
    [{}, {"stamped_headers": None, "stamps": {}}, {"stamped_headers": ["a"], "stamps": {"a": 1}}],
)
def test_usual_stamps_pass(request_dict: dict[str, Any]) -> None:
    from celery_explicit.request import _wrong_stamps

    assert _wrong_stamps(request_dict) is None


@pytest.mark.parametrize(
    ("request_dict", "named"),
    [
        ({"stamped_headers": [[], {}], "stamps": {}}, "stamped_headers"),
        ({"stamped_headers": [None]}, "stamped_headers"),
        ({"stamped_headers": 5}, "stamped_headers"),
        ({"stamped_headers": ["a"], "stamps": [1]}, "stamps"),
        ({"stamps": [1]}, "stamps"),
    ],
)
def test_wrong_stamps_are_named(request_dict: dict[str, Any], named: str) -> None:
    from celery_explicit.request import _wrong_stamps

    why = _wrong_stamps(request_dict)
    assert why is not None and why.startswith(named)
