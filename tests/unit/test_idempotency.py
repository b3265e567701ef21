from __future__ import annotations

import pytest

from celery_explicit import BadInput
from celery_explicit.keys import fingerprint, render_key, template_fields


def test_template_fields_take_the_root_name() -> None:
    assert template_fields("order:{order.id}:{items[0]}:{kind}") == ("order", "items", "kind")


def test_render_key_uses_given_arguments() -> None:
    assert render_key("t", "payment:{payment_id}:capture", {"payment_id": 7}) == "payment:7:capture"


@pytest.mark.parametrize(
    ("given", "needle"),
    [
        ({}, "field 'payment_id' is missing from the arguments"),
        ({"payment_id": None}, "field 'payment_id' is None"),
        ({"payment_id": "x" * 300}, "longer than 255"),
    ],
)
def test_render_key_refuses_bad_input_naming_task_and_field(
    given: dict[str, object], needle: str
) -> None:
    with pytest.raises(BadInput, match=needle) as caught:
        render_key("shop.capture", "payment:{payment_id}:capture", given)
    assert caught.value.task_name == "shop.capture"


def test_callable_key() -> None:
    def key(order_id: int, line: int) -> str:
        return f"order:{order_id}:line:{line}"

    assert render_key("t", key, {"order_id": 1, "line": 2, "other": 3}) == "order:1:line:2"
    with pytest.raises(BadInput, match="'line' is missing"):
        render_key("t", key, {"order_id": 1})
    with pytest.raises(BadInput, match="not a non-empty string"):
        render_key("t", lambda order_id: "", {"order_id": 1})


def test_fingerprint_is_stable_and_argument_sensitive() -> None:
    assert fingerprint({"a": 1, "b": 2}) == fingerprint({"b": 2, "a": 1})
    assert fingerprint({"a": 1, "b": 2}) != fingerprint({"a": 1, "b": 3})


@pytest.mark.parametrize(
    ("declaration", "given"),
    [
        ("order:{order[id]}", {"order": [1, 2]}),
        ("n:{n[0]}", {"n": 5}),
        (lambda items: f"first:{items[0]}", {"items": []}),
        (lambda a: f"inv:{1 / a}", {"a": 0}),
    ],
)
def test_any_rendering_failure_is_bad_input(declaration: object, given: dict[str, object]) -> None:
    with pytest.raises(BadInput, match=r"shop\.t: "):
        render_key("shop.t", declaration, given)  # type: ignore[arg-type]


def test_a_none_field_of_a_callable_key_is_bad_input() -> None:
    with pytest.raises(BadInput, match="field 'payment_id' is None"):
        render_key("t", lambda payment_id: f"payment:{payment_id}", {"payment_id": None})


def test_dedup_keys_are_named_as_such_in_errors() -> None:
    with pytest.raises(BadInput, match="dedup key field 'event_id' is missing"):
        render_key("t", "{event_id}", {}, label="dedup key")


def test_a_default_does_not_change_the_identity_fingerprint() -> None:
    import inspect

    from celery_explicit.keys import fingerprint, identity_fingerprint

    def before(ref: str) -> None: ...
    def after(ref: str, currency: str = "EUR") -> None: ...

    old = identity_fingerprint({"ref": "a"}, inspect.signature(before))
    # A parameter added with a default, passed or not at its default: the same call.
    assert identity_fingerprint({"ref": "a", "currency": "EUR"}, inspect.signature(after)) == old
    # Another value is another call; the form with every default stays distinct.
    assert identity_fingerprint({"ref": "a", "currency": "USD"}, inspect.signature(after)) != old
    assert fingerprint({"ref": "a", "currency": "EUR"}) != old


@pytest.mark.parametrize("header", [["cap:a"], "", "x" * 256, 7])
def test_a_malformed_key_header_is_bad_input_naming_the_task(header: object) -> None:
    from types import SimpleNamespace

    from celery_explicit.errors import BadInput
    from celery_explicit.key_history import published_key

    with pytest.raises(BadInput, match=r"shop\.capture.*idempotency_key"):
        published_key("shop.capture", SimpleNamespace(idempotency_key=header))
    assert published_key("shop.capture", SimpleNamespace(idempotency_key="cap:a")) == "cap:a"
    assert published_key("shop.capture", SimpleNamespace()) is None
