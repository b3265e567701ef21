"""A keyed rate limit is refused at definition, naming the task, the field and a fix."""

from __future__ import annotations

from typing import Any

import pytest

from celery_explicit import ContractError, ExplicitTask, RateLimit
from celery_explicit.rate_limit import SLOT_HEADER, reservation


def define(rate_limit: Any, **extra: Any) -> type[ExplicitTask]:
    def run(self: Any, account_id: str, amount: int, card_number: str = "") -> None:
        return None

    body = {
        "name": "shop.capture_charge",
        "idempotency_key": "charge:{account_id}:{amount}",
        "visibility_timeout": 60,
        "expected_duration": 5,
        "retry_on": (),
        "fail_on": (),
        "rate_limit": rate_limit,
        "run": run,
        **extra,
    }
    return type("CaptureCharge", (ExplicitTask,), body)


def test_a_declared_limit_is_in_the_contract_and_hidden_from_celerys_bucket() -> None:
    limit = RateLimit("stripe:{account_id}", 100, per=1.0)
    task = define(limit)
    assert task.contract.rate_limit is limit
    assert [step.name for step in task.job_steps][-1] == "rate_limit"
    # Celery's worker builds a per-worker token bucket from ``rate_limit``: none.
    assert task.rate_limit is None


def test_a_task_without_a_limit_has_no_step() -> None:
    task = define(None)
    assert task.contract.rate_limit is None
    assert "rate_limit" not in [step.name for step in task.job_steps]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("stripe:{account_id}", 0), "limit=0 must be an integer >= 1 (a limit of 0 would never"),
        (("stripe:{account_id}", -3), "limit=-3 must be an integer >= 1"),
        (("stripe:{account_id}", 2.5), "limit=2.5 must be an integer >= 1"),
        (("stripe:{account_id}", 10, 0), "per=0 must be a positive number of seconds"),
        (("stripe:{account_id}", 10, float("inf")), "per=inf must be a positive number"),
        (("", 10), "key must be a template"),
    ],
)
def test_a_limit_that_can_never_admit_or_has_no_key_is_refused(
    args: tuple[Any, ...], words: str
) -> None:
    with pytest.raises(ValueError, match="RateLimit") as caught:
        RateLimit(*args)
    assert words in str(caught.value)


def test_celerys_per_worker_string_is_refused_with_the_fix() -> None:
    with pytest.raises(ContractError) as caught:
        define("10/s")
    message = str(caught.value)
    assert "shop.capture_charge" in message
    assert "rate_limit='10/s' is Celery's per-worker limit" in message
    assert "RateLimit(" in message
    assert caught.value.field == "rate_limit"


def test_a_key_field_that_is_not_a_run_parameter_is_refused() -> None:
    with pytest.raises(ContractError) as caught:
        define(RateLimit("stripe:{account}", 10))
    assert "rate_limit field 'account' is not a parameter of run()" in str(caught.value)
    assert "shop.capture_charge" in str(caught.value)


def test_a_key_without_a_field_is_refused() -> None:
    with pytest.raises(ContractError) as caught:
        define(RateLimit("stripe", 10))
    assert "rate_limit 'stripe' has no field" in str(caught.value)


def test_something_else_is_refused() -> None:
    with pytest.raises(ContractError) as caught:
        define(100)
    assert "rate_limit=100 must be a celery_explicit.RateLimit" in str(caught.value)


def test_a_sensitive_field_may_enter_the_key_only_hashed() -> None:
    with pytest.raises(ContractError) as caught:
        define(RateLimit("card:{card_number}", 10), sensitive=("card_number",))
    assert "rate_limit 'card:{card_number}' shows the sensitive field 'card_number'" in str(
        caught.value
    )
    task = define(RateLimit("card:{card_number|sha256}", 10), sensitive=("card_number",))
    assert task.contract.rate_limit is not None


class Request:
    def __init__(self, retries: int, slot: object) -> None:
        self.retries = retries
        setattr(self, SLOT_HEADER, slot)


def test_a_reservation_holds_for_its_own_attempt_only() -> None:
    assert reservation(Request(0, "0:1764724800123")) == 1764724800123
    assert reservation(Request(2, "2:5")) == 5
    # Celery copies a message's headers onto its retry: the retry asks again.
    assert reservation(Request(1, "0:1764724800123")) is None
    assert reservation(Request(0, None)) is None
    assert reservation(Request(0, "garbage")) is None
    assert reservation(Request(0, "0:not-a-time")) is None
