"""The shape of the job path: which steps a task gets, in which order; the store it
records into; the settings object; the script registry's own refusals."""

from __future__ import annotations

from typing import Any

import pytest

from celery_explicit import Downstream, ExplicitError, ExplicitTask, redis_scripts, store
from celery_explicit.conf import settings
from celery_explicit.headers import REDELIVERED_HEADER


class GatewayTimeout(Exception):
    pass


def define(**declarations: Any) -> type[ExplicitTask]:
    def run(self: Any, order_id: int, event_id: str = "") -> None:
        return None

    body: dict[str, Any] = {
        "name": "shop.apply_event",
        "idempotency_key": "order:{order_id}:event:{event_id}",
        "visibility_timeout": 60,
        "expected_duration": 5,
        "retry_on": (GatewayTimeout,),
        "fail_on": (),
        "run": run,
        **declarations,
    }
    return type("ApplyEvent", (ExplicitTask,), body)


def test_every_task_gets_the_database_probe_the_delivery_limit_and_the_execution_lease() -> None:
    names = [step.name for step in define().job_steps]
    assert names == ["database", "delivery_limit", "execution_lease"]


def test_declared_mechanisms_join_the_path_in_the_fixed_order() -> None:
    task = define(
        dedup_key="{event_id}",
        dedup_window=60,
        ordering_key="order:{order_id}",
        downstream=Downstream("warehouse-shape", concurrency=2),
    )
    names = [step.name for step in task.job_steps]
    assert names == [
        "database",
        "delivery_limit",
        "dedup",
        "ordering",
        "execution_lease",
        "downstream",
    ]


def test_without_a_registered_store_the_job_path_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(store, "_store", None)
    with pytest.raises(ExplicitError, match="INSTALLED_APPS"):
        store.get()


def test_django_outbox_registers_its_store_when_django_loads_it() -> None:
    from django_outbox.store.backend import DjangoStore

    assert isinstance(store.get(), DjangoStore)


def test_incident_switches_come_from_the_environment_unless_django_sets_them(
    monkeypatch: pytest.MonkeyPatch, settings_override: Any
) -> None:
    assert settings.execution_lease is True  # the default: on
    monkeypatch.setenv("EXPLICIT_EXECUTION_LEASE", "0")
    assert settings.execution_lease is False
    monkeypatch.setenv("EXPLICIT_EXECUTION_LEASE", "false")
    assert settings.execution_lease is False
    settings_override.EXPLICIT_EXECUTION_LEASE = True  # a Django setting wins
    assert settings.execution_lease is True


def test_settings_are_read_at_call_time(settings_override: Any) -> None:
    settings_override.EXPLICIT_KEY_PREFIX = "other:"
    assert settings.key_prefix == "other:"
    settings_override.EXPLICIT_OUTBOX_BATCH_SIZE = "7"
    assert settings.outbox_batch_size == 7


def test_a_remembered_setting_is_forgotten_when_a_setting_changes(settings_override: Any) -> None:
    assert settings.outbox_max_attempts == 10
    assert "outbox_max_attempts" in vars(settings)  # remembered: no lookup next time
    settings_override.EXPLICIT_OUTBOX_MAX_ATTEMPTS = 3  # sends setting_changed
    assert "outbox_max_attempts" not in vars(settings)
    assert settings.outbox_max_attempts == 3
    settings_override.EXPLICIT_OUTBOX_MAX_ATTEMPTS = 5
    assert settings.outbox_max_attempts == 5


def test_only_switches_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXPLICIT_KEY_PREFIX", "from-env:")
    assert settings.key_prefix == "explicit:"


def test_a_script_name_is_one_script() -> None:
    redis_scripts.Script("test_shape_once", "return 1")
    redis_scripts.Script("test_shape_once", "return 1")  # the same script again: fine
    with pytest.raises(ValueError, match="two different scripts"):
        redis_scripts.Script("test_shape_once", "return 2")
    with pytest.raises(ValueError, match="identifier"):
        redis_scripts.Script("not a name", "return 1")


@pytest.fixture
def settings_override(settings: Any) -> Any:
    """pytest-django's ``settings`` fixture, named apart from our settings object."""
    return settings


def test_a_deferred_redelivery_is_still_recorded_as_one() -> None:
    """A redelivered message deferred by a step runs as a re-published copy, which the
    broker does not flag; the header the deferral adds keeps the attempt row truthful."""
    import datetime as dt
    from types import SimpleNamespace

    from celery_explicit import records, republish
    from celery_explicit.execution import Execution
    from celery_explicit.outcomes import Outcome

    execution = Execution(
        task_id="t",
        task_name="shop.ship_order",
        key="order:1:ship",
        fingerprint="f",
        attempt=1,
        started_at=dt.datetime.now(dt.UTC),
        correlation_id="",
    )
    copy = SimpleNamespace(delivery_info={"redelivered": False}, hostname="w", retries=0)
    assert not records.fields_of(execution, copy, Outcome.APPLIED)["redelivered"]
    setattr(copy, REDELIVERED_HEADER, True)
    assert republish.redelivered(copy)
    assert records.fields_of(execution, copy, Outcome.APPLIED)["redelivered"]
