"""A django.tasks task on ExplicitBackend is refused at decoration, naming the task, the
field and the fix; a valid one is an ExplicitTask registered under its module path.

Django 6.1+ only (tests/conftest.py collects it there).
"""

from __future__ import annotations

from typing import Any

import pytest
from django.tasks import task
from django.tasks.exceptions import InvalidTask

from celery_explicit import ContractError, ExplicitTask
from django_outbox.tasks_backend import ContractRefused, explicit_task

VALID: dict[str, Any] = {
    "idempotency_key": "capture:{payment_id}",
    "visibility_timeout": 60,
    "expected_duration": 5,
    "retry_on": (TimeoutError,),
    "fail_on": (ValueError,),
}


@pytest.fixture(autouse=True)
def forget_registered_tasks() -> Any:
    """Take the tasks a case registers out of the Celery app again: they stay in the
    process's app otherwise, and a later test that reads every registered task (the
    system checks, against a 45 s broker lease) would find this module's 60 s lease."""
    from django_outbox import tasks_backend
    from tests.celery_app import app

    before = set(app.tasks)
    yield
    for name in set(app.tasks) - before:
        del app.tasks[name]
    tasks_backend._built.clear()


# django.tasks takes module-level functions only: one per case, so no case meets a
# Celery task another one registered.
def capture(payment_id: int) -> None:
    return None


def no_key(payment_id: int) -> None:
    return None


def short_lease(payment_id: int) -> None:
    return None


def both_ways(payment_id: int) -> None:
    return None


def unknown_field(payment_id: int) -> None:
    return None


def with_context(context: Any, payment_id: int) -> None:
    return None


def declared_twice(payment_id: int) -> None:
    return None


def test_a_valid_task_runs_as_an_explicit_task_named_after_its_module_path() -> None:
    from tests.celery_app import app

    declared = task(**VALID)(capture)
    celery_task = app.tasks[f"{__name__}.capture"]
    assert isinstance(celery_task, ExplicitTask)
    assert explicit_task(declared) is celery_task  # .using() and re-validation find it
    assert celery_task.contract.visibility_timeout == 60
    assert celery_task.contract.retry.fail_on == (ValueError,)


@pytest.mark.parametrize(
    ("function", "changes", "field", "says"),
    [
        (no_key, {"idempotency_key": None}, "idempotency_key", "@task(idempotency_key="),
        (short_lease, {"visibility_timeout": 6}, "visibility_timeout", "no safe margin"),
        (both_ways, {"retry_on": (ValueError,)}, "fail_on", "both retryable"),
        (unknown_field, {"idempotency_key": "x:{order_id}"}, "idempotency_key", "order_id"),
    ],
    ids=["missing", "lease-shorter-than-run", "retry-and-permanent", "key-field"],
)
def test_a_refused_contract_names_the_task_the_field_and_the_fix(
    function: Any, changes: dict[str, Any], field: str, says: str
) -> None:
    declarations = {k: v for k, v in {**VALID, **changes}.items() if v is not None}
    with pytest.raises(ContractRefused) as refused:
        task(**declarations)(function)
    error = refused.value
    # Django's error for its callers, ours for manage.py check (django_outbox.E001).
    assert isinstance(error, InvalidTask) and isinstance(error, ContractError)
    assert error.task_name == f"{__name__}.{function.__name__}"
    assert error.field == field
    assert error.task_name in str(error)
    assert says in f"{error} {error.hint}"


def test_takes_context_is_refused() -> None:
    with pytest.raises(InvalidTask, match="takes_context=True is not supported"):
        task(takes_context=True, **VALID)(with_context)


def test_one_name_runs_one_contract() -> None:
    first = task(**VALID)(declared_twice)
    assert explicit_task(first.using(queue_name="other")).name == first.module_path
    with pytest.raises(ContractRefused, match="one name runs one contract") as refused:
        task(**{**VALID, "visibility_timeout": 120})(declared_twice)
    assert refused.value.field == "name"
