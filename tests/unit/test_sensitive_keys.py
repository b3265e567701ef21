"""A sensitive field in a key template: refused in the clear when the class is created,
allowed hashed (``{card|sha256}``); the filter renders the same digest for every key
kind, and ``Redaction`` scrubs what a call may show."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from celery_explicit import ExplicitTask, keys, sensitive
from celery_explicit.errors import ContractError


def charge_task(**declarations: Any) -> type[ExplicitTask]:
    body: dict[str, Any] = {
        "name": "tests.keys.charge",
        "idempotency_key": "charge:{ref}",
        "visibility_timeout": 10,
        "expected_duration": 1,
        "retry_on": (),
        "fail_on": (),
        "sensitive": ("card",),
        "run": lambda self, ref, card: None,
        **declarations,
    }
    return type("Charge", (ExplicitTask,), body)


@pytest.mark.parametrize(
    ("attr", "declarations"),
    [
        ("idempotency_key", {"idempotency_key": "charge:{ref}:{card}"}),
        ("idempotency_key", {"idempotency_key": "charge:{card[0]}"}),
        ("dedup_key", {"dedup_key": "d:{card}", "dedup_window": 5}),
        ("ordering_key", {"ordering_key": "o:{card}"}),
        ("idempotency_key", {"idempotency_key": lambda ref, card: f"c:{ref}"}),
    ],
)
def test_a_sensitive_field_in_a_key_is_refused(attr: str, declarations: dict[str, Any]) -> None:
    with pytest.raises(ContractError) as caught:
        charge_task(**declarations)
    error = caught.value
    assert error.task_name == "tests.keys.charge" and error.field == attr
    assert "sensitive field 'card'" in str(error)
    assert "{card|sha256}" in error.hint


def test_a_hashed_sensitive_field_is_allowed_in_every_key_kind() -> None:
    task = charge_task(
        idempotency_key="charge:{card|sha256}",
        dedup_key="d:{card|sha256}",
        dedup_window=5,
        ordering_key="o:{card|sha256}",
    )
    digest = hashlib.sha256(b"4111222233334444").hexdigest()
    given = {"ref": "r", "card": "4111222233334444"}
    contract = task.contract
    assert contract.dedup is not None and contract.ordering is not None
    for key, expected in (
        (contract.idempotency_key, f"charge:{digest}"),
        (contract.dedup.key, f"d:{digest}"),
        (contract.ordering.key, f"o:{digest}"),
    ):
        assert keys.render_key(task.name, key, given) == expected


def test_the_sha256_filter_renders_a_full_digest_of_the_value_or_its_attribute() -> None:
    assert keys.render_key("t", "{n|sha256}", {"n": 42}) == hashlib.sha256(b"42").hexdigest()
    assert keys.render_key("t", "{o[k]|sha256}:{p}", {"o": {"k": "v"}, "p": 1}) == (
        hashlib.sha256(b"v").hexdigest() + ":1"
    )
    assert keys.template_field_uses("a:{x|sha256}:{y.z}") == (("x", True), ("y", False))
    assert keys.template_fields("a:{x|sha256}") == ("x",)


def test_an_unknown_filter_is_refused() -> None:
    with pytest.raises(ContractError, match=r"the only filter is \|sha256"):
        charge_task(idempotency_key="charge:{ref|md5}")


def test_a_task_without_sensitive_fields_keeps_any_template() -> None:
    assert charge_task(sensitive=(), idempotency_key="charge:{card}").contract.sensitive == ()


def test_a_redaction_scrubs_arguments_text_and_a_copy_of_the_error() -> None:
    sig = charge_task().contract.signature
    shown = sensitive.of_call(("card",), sig, ["r", "4111222233334444"], {})
    assert shown.arguments(["r", "4111222233334444"], {}) == (["r", "[redacted]"], {})
    assert shown.text('["r", "4111222233334444"]') == '["r", "[redacted]"]'
    raised = TimeoutError("timed out charging card 4111222233334444")
    copy = shown.error(raised)
    assert copy is not raised and type(copy) is TimeoutError
    assert str(copy) == "timed out charging card [redacted]"
    assert "4111222233334444" in str(raised)  # what the handler raised is untouched
    assert shown.error(ValueError("nothing to hide")).args == ("nothing to hide",)
    assert sensitive.of_call((), sig, ["r", "x"], {}) is sensitive.NONE
