"""An outbox event's payload is plain JSON: the first value that is not is named, before
the business transaction commits it."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from celery_explicit import BadInput
from django_outbox.outbox.events import check_json


@pytest.mark.parametrize(
    "value",
    [
        {},
        {"a": 1, "b": [1.5, None, True, "x", {"c": []}]},
        [1, (2, 3)],
        "é",
        10**30,
    ],
)
def test_plain_json_is_accepted(value: object) -> None:
    check_json("shop.t", "kwargs", value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"at": datetime(2024, 1, 1, tzinfo=UTC)}, "kwargs['at'] is a datetime.datetime"),
        ({"amount": Decimal("1.10")}, "kwargs['amount'] is a decimal.Decimal"),
        ({"lines": [{"qty": 1}, {"qty": {1}}]}, "kwargs['lines'][1]['qty'] is a builtins.set"),
        ({1: "a"}, "kwargs[1] has a int key, not a str"),
        ({"x": float("inf")}, "kwargs['x'] is inf, not a JSON number"),
        ({"x": "a\x00"}, "kwargs['x'] contains a NUL character"),
    ],
)
def test_the_first_value_that_is_not_json_is_named(value: object, message: str) -> None:
    with pytest.raises(BadInput) as caught:
        check_json("shop.t", "kwargs", value)
    assert str(caught.value).startswith(f"Task shop.t: outbox payload {message}")
    assert caught.value.task_name == "shop.t"
