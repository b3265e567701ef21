"""``manage.py check`` findings, and the migrations check."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.core.checks.registry import registry
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from django_outbox import checks
from tests.celery_app import app


@pytest.fixture
def conf() -> Iterator[Any]:
    saved = {
        k: app.conf.get(k)
        for k in (
            "broker_transport_options",
            "accept_content",
            "result_accept_content",
            "result_serializer",
        )
    }
    yield app.conf
    for key, value in saved.items():
        app.conf[key] = value


FAST_SWEEP = {"unacked_restore_interval": 1, "unacked_restore_throttle": 1}


def test_a_slow_restore_sweep_is_a_warning(conf: Any) -> None:
    conf.broker_transport_options = {"visibility_timeout": 60}  # kombu's 10 s x 10
    found = checks.check_celery_configuration()
    assert ids(found) == ["django_outbox.W002"]
    assert "every 100s, longer than the shortest task lease (2s)" in found[0].msg


def ids(messages: list[Any]) -> list[str]:
    return sorted(m.id for m in messages)


def test_clean_configuration_has_no_findings(conf: Any) -> None:
    assert checks.check_celery_configuration() == []
    call_command("check")


def test_broker_visibility_shorter_than_a_task_lease_is_an_error(conf: Any) -> None:
    conf.broker_transport_options = {**FAST_SWEEP, "visibility_timeout": 25}
    found = checks.check_celery_configuration()
    errors = [m for m in found if m.id == "django_outbox.E003"]
    # tests.increment and friends declare 30 s; tests.note declares 20 s.
    assert "tests.increment" in {m.obj for m in errors}
    assert "tests.note" not in {m.obj for m in errors}
    assert "visibility_timeout=30s" in errors[0].msg
    assert "raise broker_transport_options" in errors[0].hint.lower()
    with pytest.raises(SystemCheckError, match=r"django_outbox\.E003"):
        call_command("check")


def test_backoff_cap_longer_than_the_backstop_is_a_warning(conf: Any) -> None:
    conf.broker_transport_options = {**FAST_SWEEP, "visibility_timeout": 45}
    found = checks.check_celery_configuration()
    assert ids(found) == ["django_outbox.W001"] * len(found)
    assert {m.obj for m in found} >= {"tests.increment"}  # backoff_cap 60 s by default


def test_pickle_is_an_error(conf: Any) -> None:
    conf.accept_content = ["json", "pickle"]
    found = checks.check_celery_configuration()
    assert ids(found) == ["django_outbox.E002"]
    assert "accept_content" in found[0].msg


def test_contract_error_of_a_decorator_task_surfaces_in_check() -> None:
    with override_settings(EXPLICIT_CELERY_APP="tests.broken_app.app"):
        found = checks.check_celery_configuration()
    assert ids(found) == ["django_outbox.E001"]
    assert "tests.broken_missing_key: missing declaration 'idempotency_key'" in found[0].msg
    assert found[0].obj == "tests.broken_missing_key"
    # The hint is an example from the task's own run() parameters, not "fix it".
    assert found[0].hint == (
        "Declare it on the task: idempotency_key = 'broken_missing_key:{order_id}' "
        "(the effect's business identity)"
    )


def test_an_app_without_a_broker_url_is_a_warning(conf: Any) -> None:
    saved = app.conf.broker_url
    app.conf.broker_url = None
    try:
        found = checks.check_celery_configuration()
    finally:
        app.conf.broker_url = saved
    assert "django_outbox.W003" in ids(found)
    [warning] = [m for m in found if m.id == "django_outbox.W003"]
    assert "amqp://guest@localhost" in warning.msg
    assert "django_outbox.W003" not in ids(checks.check_celery_configuration())


def test_unimportable_app_setting_is_an_error() -> None:
    with override_settings(EXPLICIT_CELERY_APP="tests.nowhere.app"):
        found = checks.check_celery_configuration()
    assert ids(found) == ["django_outbox.E004"]


@pytest.mark.django_db
def test_ledger_database_is_supported() -> None:
    assert checks.check_ledger_database() == []


@pytest.mark.django_db
def test_models_and_migrations_agree() -> None:
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


def test_outbox_settings_the_relay_cannot_run_with_are_errors() -> None:
    assert checks.check_settings() == []
    with override_settings(
        EXPLICIT_OUTBOX_BATCH_SIZE=0,
        EXPLICIT_OUTBOX_POLL_INTERVAL=float("inf"),
        EXPLICIT_OUTBOX_NOTIFY_CHANNEL="c" * 64,
    ):
        found = checks.check_settings()
    messages = " | ".join(m.msg for m in found)
    assert ids(found) == ["django_outbox.E006"] * 3
    assert "EXPLICIT_OUTBOX_BATCH_SIZE=0 must be at least 1" in messages
    assert "EXPLICIT_OUTBOX_POLL_INTERVAL=inf must be a finite number" in messages
    assert "must be at most 63 bytes" in messages
    with override_settings(EXPLICIT_OUTBOX_BACKOFF_BASE=10, EXPLICIT_OUTBOX_BACKOFF_CAP=1):
        (cap,) = checks.check_settings()
    assert cap.id == "django_outbox.E008"
    assert cap.msg.startswith(
        "EXPLICIT_OUTBOX_BACKOFF_CAP=1.0 must be at least EXPLICIT_OUTBOX_BACKOFF_BASE=10.0"
    )


def test_a_misspelt_setting_is_a_warning_naming_the_setting_it_resembles() -> None:
    with override_settings(EXPLICIT_METRIC_TOKEN="s3cret", EXPLICIT_REDIS_ULR="redis://x/1"):
        found = checks.check_settings()
    assert ids(found) == ["django_outbox.W013"] * 2
    by_name = {m.obj: m for m in found}
    assert by_name["EXPLICIT_METRIC_TOKEN"].msg == (
        "EXPLICIT_METRIC_TOKEN is set, but no celery-explicit setting has that name: "
        "it does nothing"
    )
    assert by_name["EXPLICIT_METRIC_TOKEN"].hint.startswith("Did you mean EXPLICIT_METRICS_TOKEN")
    # Its attribute is redis_url_setting: the documented name is what is suggested.
    assert by_name["EXPLICIT_REDIS_ULR"].hint == "Did you mean EXPLICIT_REDIS_URL?"
    with override_settings(EXPLICIT_NOTHING_LIKE_IT=1):
        (far,) = checks.check_settings()
    assert far.hint == "The settings are listed in docs/reference.md (Settings)."


def test_a_misspelt_setting_shows_in_manage_py_check(capsys: pytest.CaptureFixture[str]) -> None:
    with override_settings(EXPLICIT_CELERY_APPP="tests.celery_app.app"):
        call_command("check")
    err = capsys.readouterr().err
    assert "EXPLICIT_CELERY_APPP: (django_outbox.W013)" in err
    assert "Did you mean EXPLICIT_CELERY_APP?" in err


def test_a_value_that_cannot_be_cast_is_an_error_not_a_traceback() -> None:
    with override_settings(
        EXPLICIT_OUTBOX_BATCH_SIZE="abc",
        EXPLICIT_OUTBOX_MAX_ATTEMPTS=2.5,
        EXPLICIT_CELERY_APP=["tests.celery_app.app"],
        EXPLICIT_LEASE_EXTEND="of",
    ):
        found = checks.check_settings()
        # Every other check here reads settings; none of them may end in a traceback:
        # they wait until the value can be read.
        others = [
            check(databases=["default"])
            for check in registry.get_checks()
            if check.__module__.startswith("django_outbox.") and check is not checks.check_settings
        ]
    assert ids(found) == ["django_outbox.E007"] * 4
    by_name = {m.obj: m for m in found}
    batch = by_name["EXPLICIT_OUTBOX_BATCH_SIZE"]
    assert batch.msg.startswith("EXPLICIT_OUTBOX_BATCH_SIZE='abc' cannot be read as a whole number")
    assert batch.hint == (
        "Set EXPLICIT_OUTBOX_BATCH_SIZE to a whole number, at least 1, or remove it for "
        "the default (100)."
    )
    assert "2.5 is not a whole number" in by_name["EXPLICIT_OUTBOX_MAX_ATTEMPTS"].msg
    assert "is a list, not a string" in by_name["EXPLICIT_CELERY_APP"].msg
    assert (
        "EXPLICIT_LEASE_EXTEND='of' cannot be read as a switch"
        in by_name["EXPLICIT_LEASE_EXTEND"].msg
    )
    # checks.py's four, periodic's two, retention's two.
    assert len(others) == 8 and not any(others)


def test_an_environment_switch_that_cannot_be_cast_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EXPLICIT_WORKER_METRICS_PORT", "90o1")
    (found,) = checks.check_settings()
    assert found.id == "django_outbox.E007"
    assert found.msg.startswith("EXPLICIT_WORKER_METRICS_PORT='90o1' cannot be read")


def test_a_reconcile_horizon_at_or_below_after_is_an_error() -> None:
    with override_settings(
        EXPLICIT_OUTBOX_RECONCILE_AFTER=600, EXPLICIT_OUTBOX_RECONCILE_HORIZON=600
    ):
        (found,) = checks.check_settings()
    assert found.id == "django_outbox.E008"
    assert found.obj == "EXPLICIT_OUTBOX_RECONCILE_HORIZON"
    assert found.msg.startswith(
        "EXPLICIT_OUTBOX_RECONCILE_HORIZON=600.0 must be greater than "
        "EXPLICIT_OUTBOX_RECONCILE_AFTER=600.0: "
    )
    assert "turns reconciliation off" in found.msg
    assert "set EXPLICIT_OUTBOX_RECONCILE_AFTER = 0 to turn it off" in found.hint
    # AFTER = 0 is reconciliation off: no horizon is too short then.
    with override_settings(EXPLICIT_OUTBOX_RECONCILE_AFTER=0, EXPLICIT_OUTBOX_RECONCILE_HORIZON=1):
        assert checks.check_settings() == []
    with override_settings(EXPLICIT_OUTBOX_RECONCILE_AFTER=-1):
        (negative,) = checks.check_settings()
    assert negative.msg == "EXPLICIT_OUTBOX_RECONCILE_AFTER=-1 must be at least 0"


@pytest.mark.parametrize(
    ("name", "value", "rule"),
    [
        ("EXPLICIT_WORKER_METRICS_PORT", 65536, "must be at most 65535"),
        ("EXPLICIT_RELAY_METRICS_PORT", -1, "must be at least 0"),
        ("EXPLICIT_RETAIN_ATTEMPTS", 0, "must be greater than 0"),
        ("EXPLICIT_RETAIN_LEDGER", -86400, "must be greater than 0"),
        ("EXPLICIT_RETAIN_OUTBOX", float("nan"), "must be a finite number"),
        ("EXPLICIT_WORKER_METRICS_BIND", "0.0.0.0:9100", "must be an IP address or a host name"),
        ("EXPLICIT_WORKER_METRICS_BIND", "", "must be an IP address or a host name"),
        ("EXPLICIT_DATABASE", "ledgr", "must be one of the DATABASES aliases"),
        (
            "EXPLICIT_REDIS_URL",
            "127.0.0.1:6379",
            "must be a redis://, rediss://, unix://, sentinel:// or redis+cluster://",
        ),
        ("EXPLICIT_RABBITMQ_MANAGEMENT_URL", "rabbit:15672", "must be an http:// or https://"),
        ("EXPLICIT_CORRELATION_HEADER", "X Request Id", "must be an HTTP header name"),
    ],
)
def test_a_value_outside_its_rule_is_an_error_naming_setting_value_and_rule(
    name: str, value: object, rule: str
) -> None:
    with override_settings(**{name: value}):
        (found,) = checks.check_settings()
        # E005 reads EXPLICIT_DATABASE: an unknown alias is said once, here, not as a
        # traceback from the connection handler.
        assert checks.check_ledger_database() == []
    assert found.id == "django_outbox.E006"
    assert found.obj == name
    assert found.msg.startswith(f"{name}={value!r} {rule}")
    assert found.hint.startswith(f"Set {name} to ")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("EXPLICIT_WORKER_METRICS_BIND", "0.0.0.0"),
        ("EXPLICIT_WORKER_METRICS_BIND", "::1"),
        ("EXPLICIT_WORKER_METRICS_BIND", "metrics.internal"),
        ("EXPLICIT_WORKER_METRICS_PORT", "9100"),
        ("EXPLICIT_EXECUTION_LEASE", "off"),
        ("EXPLICIT_OUTBOX_BATCH_SIZE", 10.0),
        ("EXPLICIT_REDIS_URL", "unix:///run/redis.sock?db=2"),
        ("EXPLICIT_RABBITMQ_MANAGEMENT_URL", "off"),
    ],
)
def test_a_value_inside_its_rule_is_no_finding(name: str, value: object) -> None:
    with override_settings(**{name: value}):
        assert checks.check_settings() == []


def test_pickle_by_content_type_or_in_result_accept_content_is_an_error(conf: Any) -> None:
    saved = conf.get("result_accept_content")
    try:
        conf.accept_content = ["json", "application/x-python-serialize"]
        (found,) = checks.check_celery_configuration()
        assert found.id == "django_outbox.E002"
        assert "accept_content (application/x-python-serialize)" in found.msg
        conf.accept_content = ["json"]
        conf.result_accept_content = ["json", "Pickle"]
        (found,) = checks.check_celery_configuration()
        assert found.id == "django_outbox.E002"
        assert "result_accept_content (Pickle)" in found.msg
        conf.result_accept_content = ["application/json"]
        conf.result_serializer = "application/x-python-serialize"
        (found,) = checks.check_celery_configuration()
        assert "result_serializer (application/x-python-serialize)" in found.msg
    finally:
        conf.result_accept_content = saved
        conf.result_serializer = "json"
        conf.accept_content = ["json"]
    assert checks.check_celery_configuration() == []


def test_a_pickle_serializer_registered_under_another_name_is_an_error(conf: Any) -> None:
    """kombu decodes with pickle whatever name a serializer was registered under."""
    from kombu import serialization

    serialization.register(
        "frozen", lambda obj: obj, serialization.unpickle, "application/x-frozen", "binary"
    )
    try:
        conf.accept_content = ["json", "frozen"]
        (found,) = checks.check_celery_configuration()
        assert found.id == "django_outbox.E002"
        assert "accept_content (frozen)" in found.msg
    finally:
        serialization.registry.unregister("frozen")


def test_a_task_class_no_app_registered_is_a_warning() -> None:
    """A class-based task in an installed app that nobody registered does not exist for
    Celery; the check names it, and says nothing of the registered ones."""
    import gc

    from celery_explicit import ExplicitTask

    def run(self: Any, item: str) -> None:
        return None

    forgotten = type(
        "Forgotten",
        (ExplicitTask,),
        {
            "__module__": "tests.testapp.tasks",
            "name": "tests.forgotten",
            "idempotency_key": "forgotten:{item}",
            "visibility_timeout": 10,
            "expected_duration": 1,
            "retry_on": (),
            "fail_on": (),
            "run": run,
        },
    )
    try:
        found = [m for m in checks.check_celery_configuration() if m.id == "django_outbox.W004"]
        assert [m.obj for m in found] == ["tests.forgotten"]
        assert "app.register_task(Forgotten())" in found[0].hint
    finally:
        del forgotten
        gc.collect()
    found = [m for m in checks.check_celery_configuration() if m.id == "django_outbox.W004"]
    assert found == []


def test_a_lease_or_backoff_as_long_as_rabbitmqs_consumer_timeout_is_a_warning(
    conf: Any,
) -> None:
    saved = conf.broker_url
    conf.broker_url = "amqp://guest:guest@127.0.0.1:5672//"
    try:
        with override_settings(EXPLICIT_RABBITMQ_CONSUMER_TIMEOUT=45):
            found = checks.check_celery_configuration()
        assert "django_outbox.W011" in ids(found)
        named = {m.obj for m in found if m.id == "django_outbox.W011"}
        assert "tests.increment" in named  # backoff_cap 60 s by default
        assert "consumer_timeout of 45s" in next(m.msg for m in found if m.id.endswith("W011"))
        # RabbitMQ's own default (30 min) is longer than every test task's lease and cap.
        assert "django_outbox.W011" not in ids(checks.check_celery_configuration())
    finally:
        conf.broker_url = saved


def test_rabbitmq_without_publisher_confirms_is_a_warning(conf: Any) -> None:
    saved_url, saved_options = conf.broker_url, conf.broker_transport_options
    try:
        conf.broker_url = "amqp://guest:guest@127.0.0.1:5672//"
        conf.broker_transport_options = {}
        found = [m for m in checks.check_celery_configuration() if m.id == "django_outbox.W014"]
        assert len(found) == 1 and "without publisher confirms" in found[0].msg
        assert "confirm_publish" in str(found[0].hint)
        conf.broker_transport_options = {"confirm_publish": True}
        assert "django_outbox.W014" not in ids(checks.check_celery_configuration())
        conf.broker_url = "redis://127.0.0.1:6379/0"  # the write's reply is the confirm
        conf.broker_transport_options = {}
        assert "django_outbox.W014" not in ids(checks.check_celery_configuration())
    finally:
        conf.broker_url, conf.broker_transport_options = saved_url, saved_options


def test_prepared_messages_on_another_broker_than_redis_are_an_error(conf: Any) -> None:
    saved = conf.broker_url
    try:
        with override_settings(EXPLICIT_OUTBOX_PREPARED_MESSAGES=True):
            assert "django_outbox.E009" not in ids(checks.check_celery_configuration())
            conf.broker_url = "amqp://guest:guest@127.0.0.1:5672//"
            found = [m for m in checks.check_celery_configuration() if m.id == "django_outbox.E009"]
        assert len(found) == 1 and "EXPLICIT_OUTBOX_PREPARED_MESSAGES" in found[0].msg
        assert "'amqp' broker" in found[0].msg
        assert "django_outbox.E009" not in ids(checks.check_celery_configuration())  # off
    finally:
        conf.broker_url = saved


def test_a_soft_shutdown_shorter_than_a_job_is_a_warning(conf: Any) -> None:
    saved = conf.get("worker_soft_shutdown_timeout")
    conf.worker_soft_shutdown_timeout = 0.5
    try:
        found = [m for m in checks.check_celery_configuration() if m.id == "django_outbox.W012"]
        assert found and all("worker_soft_shutdown_timeout=0.5s" in m.msg for m in found)
        assert "tests.increment" in {m.obj for m in found}  # expects 1 s
    finally:
        conf.worker_soft_shutdown_timeout = saved
    assert not [m for m in checks.check_celery_configuration() if m.id == "django_outbox.W012"]


@pytest.mark.django_db
def test_a_renamed_key_template_is_a_warning_naming_both() -> None:
    from django.utils import timezone

    from django_outbox.models import KeyTemplate

    now = timezone.now()
    KeyTemplate.objects.create(
        task_name="tests.increment", template="count:{name}:{op_id}", first_seen=now, last_seen=now
    )
    KeyTemplate.objects.create(
        task_name="tests.increment",
        template="counter:{name}:op:{op_id}",
        first_seen=now,
        last_seen=now + timezone.timedelta(seconds=1),
    )
    assert checks.check_key_renames() == []  # only with --database
    found = checks.check_key_renames(databases=["default"])
    assert ids(found) == ["django_outbox.W010"]
    assert "'count:{name}:{op_id}' and is now 'counter:{name}:op:{op_id}'" in found[0].msg
    assert found[0].obj == "tests.increment"
