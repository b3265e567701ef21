"""django_outbox's public surface: the package's names, its exception root, and the
literal claim SQL checked against the model it names."""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import subprocess
import sys

import pytest
from django.core.exceptions import ImproperlyConfigured

import django_outbox
from celery_explicit.errors import ExplicitError
from django_outbox import errors
from django_outbox.cache import versioned
from django_outbox.models import OutboxEvent, OutboxStatus
from django_outbox.outbox.relay.claim import (
    CLAIM_BEYOND_POSTGRESQL,
    CLAIM_POSTGRESQL,
    CLAIM_SQLITE,
    STORED_COLUMNS,
    Claimed,
    claim_sql,
)
from tests.support.processes import ROOT


def test_every_public_name_resolves() -> None:
    assert len(set(django_outbox.__all__)) == len(django_outbox.__all__)
    for name in django_outbox.__all__:
        value = getattr(django_outbox, name)
        assert not isinstance(value, type(django_outbox)), f"{name} is a module"
        assert name in dir(django_outbox)
    namespace: dict[str, object] = {}
    exec("from django_outbox import *", namespace)
    assert set(django_outbox.__all__) <= set(namespace)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        django_outbox.nothing_here  # noqa: B018


def test_public_names_are_the_objects_of_their_modules() -> None:
    from django_outbox.outbox.dispatch import dispatch
    from django_outbox.outbox.events import publish_event
    from django_outbox.outbox.relay.loop import Relay
    from django_outbox.store.guarded_writes import fenced_update

    assert django_outbox.dispatch is dispatch
    assert django_outbox.fenced_update is fenced_update
    assert django_outbox.publish_event is publish_event
    assert django_outbox.Relay is Relay
    assert django_outbox.VersionedCache is versioned.VersionedCache
    assert django_outbox.CacheKeyError is errors.CacheKeyError


def test_dispatch_stays_the_function_once_its_module_is_loaded() -> None:
    # The import system sets a loaded submodule on its package: the function lives in
    # ``django_outbox.outbox.dispatch``, so loading that module leaves the package's
    # ``dispatch`` the function.
    module = importlib.import_module("django_outbox.outbox.dispatch")
    assert django_outbox.dispatch is module.dispatch
    assert callable(django_outbox.dispatch)
    assert not isinstance(django_outbox.dispatch, type(django_outbox))


def test_the_package_imports_no_model_before_django_is_set_up() -> None:
    # Django imports the package (INSTALLED_APPS) before the app registry is ready.
    code = (
        "import sys, django_outbox\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('django_outbox.'))\n"
        "assert loaded == ['django_outbox.errors'], loaded\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_the_app_errors_share_one_root_under_explicit_error() -> None:
    assert issubclass(errors.OutboxError, ExplicitError)
    assert issubclass(errors.CacheKeyError, errors.OutboxError)
    assert issubclass(errors.CacheKeyError, ValueError)
    assert issubclass(errors.CacheConfigError, errors.OutboxError)
    assert issubclass(errors.CacheConfigError, ImproperlyConfigured)
    # Still importable where the code that raises them is.
    assert versioned.CacheKeyError is errors.CacheKeyError
    assert versioned.CacheConfigError is errors.CacheConfigError
    error = errors.CacheKeyError("user_profile", "user_id", "field 'user_id' is missing")
    assert (error.cache_name, error.field) == ("user_profile", "user_id")
    assert str(error) == "Cache user_profile: field 'user_id' is missing"


# --- the claim's literal SQL -------------------------------------------------------------


@pytest.mark.parametrize(
    ("sql", "reads", "tests"),
    [(CLAIM_POSTGRESQL, 4, 3), (CLAIM_BEYOND_POSTGRESQL, 6, 5), (CLAIM_SQLITE, 3, 2)],
    ids=["postgresql", "postgresql-beyond", "sqlite"],
)
def test_the_claim_names_the_model_table_and_status(sql: str, reads: int, tests: int) -> None:
    # Written out, not built from the model: a renamed table or status must fail here.
    # (``reads``, ``tests``: how often each statement names the table and a status.)
    tables = re.findall(r"\bFROM\s+(\w+)\s+AS\b", sql)
    assert len(tables) == reads
    assert set(tables) == {OutboxEvent._meta.db_table}
    statuses = re.findall(r"\.status = '(\w+)'", sql)
    assert len(statuses) == tests
    assert set(statuses) == {OutboxStatus.PENDING.value}


@pytest.mark.parametrize(
    "sql",
    [CLAIM_POSTGRESQL, CLAIM_BEYOND_POSTGRESQL, CLAIM_SQLITE],
    ids=["postgresql", "postgresql-beyond", "sqlite"],
)
def test_the_claim_selects_the_columns_claimed_reads_in_order(sql: str) -> None:
    selected = re.search(r"\)\s*SELECT (.*?)\nFROM ", sql, re.DOTALL)
    assert selected is not None
    # A column may be cast for cheaper loading (event.event_id::text, extract(...)).
    named = [re.findall(r"\bevent\.(\w+)", column) for column in selected[1].split(",")]
    assert all(len(names) == 1 for names in named), named
    columns = [names[0] for names in named]
    fields = []
    for field in dataclasses.fields(Claimed):
        fields += STORED_COLUMNS if field.name == "stored" else [field.name]
    assert columns == fields
    assert set(columns) <= {f.column for f in OutboxEvent._meta.concrete_fields}


def test_each_database_gets_its_claim() -> None:
    assert claim_sql("postgresql") is CLAIM_POSTGRESQL
    assert claim_sql("sqlite") is CLAIM_SQLITE
    # The PostgreSQL claims lock what they return, after the LIMIT; SQLite cannot lock.
    for sql in (CLAIM_POSTGRESQL, CLAIM_BEYOND_POSTGRESQL):
        assert "MATERIALIZED" in sql
        assert "FOR UPDATE OF event SKIP LOCKED" in sql
    assert "FOR UPDATE" not in CLAIM_SQLITE
    # nothing left to format in
    assert "{" not in CLAIM_POSTGRESQL + CLAIM_BEYOND_POSTGRESQL + CLAIM_SQLITE
