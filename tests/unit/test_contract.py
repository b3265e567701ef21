"""Declarations are refused at definition, naming the task and the field."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_explicit import ContractError, ExplicitTask


class GatewayTimeout(Exception):
    pass


class CardDeclined(Exception):
    pass


VALID: dict[str, Any] = {
    "name": "shop.capture_payment",
    "idempotency_key": "payment:{payment_id}:capture",
    "visibility_timeout": 60,
    "expected_duration": 5,
    "retry_on": (GatewayTimeout,),
    "fail_on": (CardDeclined,),
}


def define(**changes: Any) -> type[ExplicitTask]:
    body = {**VALID, **changes}
    body = {k: v for k, v in body.items() if v is not DROP}

    def run(self: Any, payment_id: int) -> None:
        return None

    body.setdefault("run", run)
    return type("CapturePayment", (ExplicitTask,), body)


DROP = object()


def test_a_complete_declaration_is_accepted() -> None:
    task = define()
    assert task.contract.task_name == "shop.capture_payment"
    assert task.contract.visibility_timeout == 60.0
    assert task.contract.retry.max_attempts == 5
    assert task.acks_late is True
    assert task.reject_on_worker_lost is True
    assert task.serializer == "json"


@pytest.mark.parametrize(
    "field", ["idempotency_key", "visibility_timeout", "expected_duration", "retry_on", "fail_on"]
)
def test_each_missing_declaration_names_task_and_field(field: str) -> None:
    with pytest.raises(ContractError) as caught:
        define(**{field: DROP})
    assert caught.value.field == field
    assert "shop.capture_payment" in str(caught.value)
    assert f"missing declaration {field!r}" in str(caught.value)


def test_key_field_must_be_a_run_parameter() -> None:
    with pytest.raises(
        ContractError,
        match=r"field 'order_id' is not a parameter of run\(\) "
        r"\(parameters: payment_id\)",
    ):
        define(idempotency_key="order:{order_id}:ship")


def test_key_without_any_field_is_refused() -> None:
    with pytest.raises(ContractError, match="has no field"):
        define(idempotency_key="capture-everything")


def test_positional_key_field_is_refused() -> None:
    with pytest.raises(ContractError, match="positional field"):
        define(idempotency_key="payment:{}:capture")


def test_callable_key_is_allowed_and_its_parameters_checked() -> None:
    task = define(idempotency_key=lambda payment_id: f"payment:{payment_id}:capture")
    assert callable(task.contract.idempotency_key)
    with pytest.raises(ContractError, match="'order_id' is not a parameter"):
        define(idempotency_key=lambda order_id: f"order:{order_id}")


def test_visibility_timeout_without_safe_margin_is_refused() -> None:
    # The article's incident: a 45 s job under a 30 s visibility timeout.
    with pytest.raises(ContractError) as caught:
        define(visibility_timeout=30, expected_duration=45)
    assert caught.value.field == "visibility_timeout"
    assert "no safe margin" in str(caught.value)
    assert "at least 90s" in str(caught.value)
    with pytest.raises(ContractError, match="no safe margin"):
        define(visibility_timeout=9, expected_duration=5)
    define(visibility_timeout=10, expected_duration=5)


@pytest.mark.parametrize("value", [0, -1, "60", True, None])
def test_visibility_timeout_must_be_positive_seconds(value: object) -> None:
    with pytest.raises(ContractError, match="visibility_timeout"):
        define(visibility_timeout=value)


def test_class_both_retryable_and_permanent_is_refused() -> None:
    with pytest.raises(ContractError, match="GatewayTimeout is declared both retryable"):
        define(fail_on=(CardDeclined, GatewayTimeout))


def test_retry_on_must_hold_exception_classes() -> None:
    with pytest.raises(ContractError, match="retry_on holds 'timeout'"):
        define(retry_on=("timeout",))
    with pytest.raises(ContractError, match="must be a tuple of exception classes"):
        define(fail_on=42)


def test_typo_in_class_body_is_refused_with_a_hint() -> None:
    with pytest.raises(
        ContractError,
        match=r"unknown option 'retry_onn'; did you mean "
        r"'retry_on'\?",
    ):
        define(retry_onn=(GatewayTimeout,))


def test_class_body_helpers_far_from_any_option_are_allowed() -> None:
    task = define(gateway_client=object())
    assert task.contract is not None


@pytest.mark.parametrize(
    ("option", "value", "needle"),
    [
        ("serializer", "pickle", "code execution"),
        ("acks_late", False, "acknowledged only after"),
        ("reject_on_worker_lost", False, "delivered again"),
        ("autoretry_for", (GatewayTimeout,), "retry_on / fail_on"),
        ("max_retries", 3, "max_attempts"),
    ],
)
def test_options_that_would_undo_the_contract_are_refused(
    option: str, value: object, needle: str
) -> None:
    with pytest.raises(ContractError, match=needle) as caught:
        define(**{option: value})
    assert caught.value.field == option


def test_unclassified_and_attempt_options_are_validated() -> None:
    with pytest.raises(ContractError, match="choose 'permanent' or 'retry'"):
        define(unclassified="ignore")
    with pytest.raises(ContractError, match="max_attempts=0"):
        define(max_attempts=0)
    with pytest.raises(ContractError, match="backoff_cap=1s is below backoff_base=2s"):
        define(backoff_base=2, backoff_cap=1)
    assert define(unclassified="retry").contract.retry.unclassified.value == "retry"


def test_abstract_base_is_validated_through_its_subclasses() -> None:
    base = type(
        "ShopTask",
        (ExplicitTask,),
        {"abstract": True, "visibility_timeout": 60, "expected_duration": 5},
    )

    def run(self: Any, order_id: int) -> None:
        return None

    concrete = type(
        "Ship",
        (base,),
        {
            "name": "shop.ship",
            "run": run,
            "idempotency_key": "order:{order_id}:ship",
            "retry_on": (),
            "fail_on": (),
        },
    )
    assert concrete.contract.visibility_timeout == 60.0
    with pytest.raises(ContractError, match="missing declaration 'retry_on'"):
        type(
            "Ship2",
            (base,),
            {"name": "shop.ship2", "run": run, "idempotency_key": "order:{order_id}:ship"},
        )


def make_app() -> Celery:
    return Celery("contract-tests", set_as_current=False, broker="memory://")


def test_decorator_form_is_accepted_and_validated() -> None:
    app = make_app()

    @app.task(
        base=ExplicitTask,
        shared=False,
        name="shop.send_invoice_email",
        idempotency_key="invoice:{invoice_id}:send_email",
        visibility_timeout=120,
        expected_duration=10,
        retry_on=(GatewayTimeout,),
        fail_on=(CardDeclined,),
    )
    def send_invoice_email(invoice_id: int) -> None:
        return None

    assert send_invoice_email.contract.task_name == "shop.send_invoice_email"
    assert send_invoice_email.contract.run_parameters == ("invoice_id",)


def test_decorator_form_refuses_any_unknown_option() -> None:
    app = make_app()

    @app.task(
        base=ExplicitTask,
        shared=False,
        name="shop.send_invoice_email_typo",
        idempotency_key="invoice:{invoice_id}:send_email",
        visibility_timeout=120,
        expected_duration=10,
        retry_on=(GatewayTimeout,),
        fail_on=(),
        retry_onn=(CardDeclined,),
    )
    def send_invoice_email(invoice_id: int) -> None:
        return None

    # Celery returns a lazy proxy until the app finalizes: the error surfaces then.
    with pytest.raises(
        ContractError,
        match=r"shop.send_invoice_email_typo: unknown option "
        r"'retry_onn'; did you mean 'retry_on'\?",
    ):
        app.finalize(auto=True)


def test_decorator_form_with_bind_checks_parameters_after_self() -> None:
    app = make_app()

    @app.task(
        base=ExplicitTask,
        shared=False,
        bind=True,
        name="shop.bound",
        idempotency_key="invoice:{invoice_id}",
        visibility_timeout=120,
        expected_duration=10,
        retry_on=(),
        fail_on=(),
    )
    def bound(self: Any, invoice_id: int) -> None:
        return None

    assert bound.contract.run_parameters == ("invoice_id",)


def test_dedup_declaration_is_checked_against_run() -> None:
    task = define(dedup_key="{payment_id}", dedup_window=600)
    assert task.contract.dedup is not None
    assert task.contract.dedup.window == 600.0
    with pytest.raises(ContractError, match="dedup_key field 'event_id' is not a parameter"):
        define(dedup_key="{event_id}", dedup_window=600)
    with pytest.raises(ContractError, match="dedup_key is declared without dedup_window"):
        define(dedup_key="{payment_id}")
    with pytest.raises(ContractError, match="dedup_window is declared without dedup_key"):
        define(dedup_window=60)
    with pytest.raises(ContractError, match="dedup_window=0 must be a positive, finite number"):
        define(dedup_key="{payment_id}", dedup_window=0)
    assert define().contract.dedup is None


def test_an_abstract_base_cannot_smuggle_refused_options() -> None:
    base = type("LooseBase", (ExplicitTask,), {"abstract": True, "acks_late": False})
    with pytest.raises(ContractError, match="acks_late=False is refused"):
        type("Child", (base,), {**VALID, "run": lambda self, payment_id: None})
    base2 = type("RetryBase", (ExplicitTask,), {"abstract": True, "autoretry_for": (KeyError,)})
    with pytest.raises(ContractError, match="option 'autoretry_for' is not used"):
        type("Child2", (base2,), {**VALID, "run": lambda self, payment_id: None})


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_durations_are_refused(value: float) -> None:
    with pytest.raises(ContractError, match="positive, finite number"):
        define(visibility_timeout=value)
    with pytest.raises(ContractError, match="positive, finite number"):
        define(backoff_cap=value)


def test_a_constant_callable_key_is_refused() -> None:
    with pytest.raises(ContractError, match="callable takes no parameter"):
        define(idempotency_key=staticmethod(lambda: "constant"))


def test_positional_only_parameters_can_be_key_fields() -> None:
    def run(self: Any, payment_id: int, /) -> None:
        return None

    assert define(run=run).contract.run_parameters == ("payment_id",)


def test_an_unnamed_task_is_named_by_its_class_path() -> None:
    body = {k: v for k, v in VALID.items() if k != "name"}
    with pytest.raises(
        ContractError,
        match=r"Task tests\.unit\.test_contract\.Unnamed: "
        r"idempotency_key must be",
    ):
        type(
            "Unnamed",
            (ExplicitTask,),
            {
                **body,
                "idempotency_key": 42,
                "run": lambda self, payment_id: None,
                "__module__": __name__,
            },
        )


def test_max_deliveries_is_validated() -> None:
    assert define().contract.max_deliveries == 5
    assert define(max_deliveries=2).contract.max_deliveries == 2
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ContractError, match=r"max_deliveries=.* must be an integer >= 1"):
            define(max_deliveries=bad)


def test_max_run_time_sets_celery_limits_and_must_cover_a_normal_run() -> None:
    task = define(max_run_time=20)
    assert task.contract.max_run_time == 20.0
    assert task.soft_time_limit == 20.0
    assert task.time_limit == 22.0
    assert define().contract.max_run_time is None
    with pytest.raises(ContractError, match="max_run_time=2s is shorter than expected_duration"):
        define(max_run_time=2)


def test_downstream_declaration_is_validated() -> None:
    from celery_explicit import Downstream

    wh = Downstream("wh", concurrency=2)
    assert define(downstream=wh).contract.downstream is wh
    with pytest.raises(ContractError, match="downstream='warehouse' must be a celery_explicit"):
        define(downstream="warehouse")
    for kwargs, needle in [
        ({"concurrency": 0}, "concurrency=0"),
        ({"concurrency": 1, "cool_down": 0}, "cool_down=0"),
        ({"concurrency": 1, "failure_threshold": True}, "failure_threshold"),
    ]:
        with pytest.raises(ValueError, match=f"Downstream 'wh': {needle}"):
            Downstream("wh", **kwargs)  # type: ignore[arg-type]


def test_ordering_declaration_is_checked_against_run() -> None:
    task = define(ordering_key="payment:{payment_id}")
    ordering = task.contract.ordering
    assert ordering is not None and ordering.key == "payment:{payment_id}"
    # Default gap: two leases plus the longest backoff (60 + 60 + 60 s here).
    assert ordering.gap == 2 * 60 + 60
    assert define(ordering_key="payment:{payment_id}", ordering_gap=5).contract.ordering.gap == 5
    with pytest.raises(
        ContractError,
        match=r"shop\.capture_payment.*ordering_key field "
        r"'order_id' is not a parameter of run",
    ):
        define(ordering_key="order:{order_id}")
    with pytest.raises(ContractError, match="ordering_key 'orders' has no field"):
        define(ordering_key="orders")
    with pytest.raises(ContractError, match="ordering_key must be a template string"):
        define(ordering_key=42)
    with pytest.raises(ContractError, match="ordering_gap is declared without ordering_key"):
        define(ordering_gap=30)
    with pytest.raises(ContractError, match="ordering_gap=-1 must be a positive"):
        define(ordering_key="payment:{payment_id}", ordering_gap=-1)
    assert define().contract.ordering is None


def test_a_missing_key_is_shown_an_example_from_the_tasks_own_parameters() -> None:
    with pytest.raises(ContractError) as caught:
        define(idempotency_key=DROP)
    assert "for example idempotency_key = 'capture_payment:{payment_id}'" in str(caught.value)
    assert caught.value.hint.startswith("Declare it on the task: idempotency_key = ")


def test_autoretry_for_gets_the_same_message_in_the_decorator_and_the_class() -> None:
    app = make_app()
    with pytest.raises(ContractError) as decorated:

        @app.task(
            base=ExplicitTask,
            shared=False,
            name="shop.autoretry_decorated",
            idempotency_key="invoice:{invoice_id}:send_email",
            visibility_timeout=120,
            expected_duration=10,
            retry_on=(GatewayTimeout,),
            fail_on=(CardDeclined,),
            autoretry_for=(GatewayTimeout,),
        )
        def send(invoice_id: int) -> None:
            return None

        send.contract  # noqa: B018  (a decorator task is built when first used)
    with pytest.raises(ContractError) as in_class:
        define(autoretry_for=(GatewayTimeout,))
    expected = "option 'autoretry_for' is not used by ExplicitTask: declare retry_on / fail_on"
    assert expected in str(decorated.value)
    assert expected in str(in_class.value)
