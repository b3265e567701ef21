"""Key templates and bad input for django_outbox.cache.versioned: refused before Redis is touched,
with an error naming the cache and the field."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from celery_explicit import ExplicitError
from django_outbox.cache.versioned import (
    CacheAside,
    CacheConfigError,
    CacheKeyError,
    VersionedCache,
)


def source(**fields: Any) -> tuple[str, int]:
    raise AssertionError("bad input must be refused before the source is read")


def profiles(key: str = "user_profile:{user_id}", **options: Any) -> Any:
    return VersionedCache(key, source=source, **options)


@pytest.mark.parametrize(
    ("key", "field", "message"),
    [
        ("{user_id}", None, "must start with a literal name and a colon"),
        ("user_profile", None, "must start with a literal name and a colon"),
        ("user_profile:{}", None, "must be a plain name"),
        ("user_profile:{0}", "0", "must be a plain name"),
        ("user_profile:{user.id}", "user.id", "must be a plain name"),
        ("user_profile:{user_id:05d}", "user_id", "format spec or conversion"),
        ("user_profile:{user_id!r}", "user_id", "format spec or conversion"),
        ("user_profile:{user_id", None, "expected '}'"),
        ("user_profile:{user_id}:v{version}", "version", "the version is stored with the value"),
        ("user_profile:{using}", "using", "'using' is reserved"),
    ],
)
def test_bad_templates_are_refused_at_declaration(
    key: str, field: str | None, message: str
) -> None:
    with pytest.raises(
        CacheConfigError, match=message.replace("{", r"\{").replace("(", r"\(")
    ) as caught:
        profiles(key)
    assert caught.value.field == field
    assert isinstance(caught.value, ImproperlyConfigured | ExplicitError)


def test_a_cache_aside_template_with_a_version_points_to_versioned_cache() -> None:
    with pytest.raises(CacheConfigError, match="use VersionedCache") as caught:
        CacheAside("user_name:{user_id}:v{version}", source=source)
    assert (caught.value.cache_name, caught.value.field) == ("user_name", "version")


@pytest.mark.parametrize("option", ["timeout", "lease"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "30", None])
def test_durations_must_be_positive_finite_seconds(option: str, value: object) -> None:
    with pytest.raises(
        CacheConfigError,
        match=f"Cache user_name: {option}=.* must be a positive, finite number of seconds",
    ) as caught:
        CacheAside("user_name:{user_id}", source=source, **{option: value})
    assert caught.value.field == option


def test_a_template_without_fields_is_one_entity() -> None:
    settings_cache = profiles("site_settings:current")
    assert settings_cache.name == "site_settings"
    with pytest.raises(CacheKeyError, match=r"field 'site' is not in the key .* none"):
        settings_cache.get(site=1)


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({}, "user_id", "field 'user_id' is missing"),
        ({"user_id": 1, "uid": 1}, "uid", "field 'uid' is not in the key"),
        ({"uid": 1}, "user_id", "field 'user_id' is missing"),
        ({"user_id": None}, "user_id", "field 'user_id' is None"),
        ({"user_id": True}, "user_id", r"is a bool \(True\), not an int, str or UUID"),
        ({"user_id": 1.0}, "user_id", r"is a float \(1.0\)"),
        ({"user_id": b"1"}, "user_id", "is a bytes"),
        ({"user_id": ""}, "user_id", "field 'user_id' is empty"),
        ({"user_id": "1:v2"}, "user_id", "contains ':'"),
        ({"user_id": 1, "version": 2}, "version", "the version is not a key field"),
    ],
)
def test_fields_that_do_not_fit_name_the_cache_and_the_field(
    fields: dict[str, Any], field: str, message: str
) -> None:
    cache = profiles()
    for call in (cache.get, cache.get_versioned, cache.verify, lambda **f: cache.bump(1, **f)):
        with pytest.raises(CacheKeyError, match=f"^Cache user_profile: .*{message}") as caught:
            call(**fields)
        assert (caught.value.cache_name, caught.value.field) == ("user_profile", field)
        assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("version", [-1, 1.0, "2", True, None])
def test_bump_refuses_a_version_that_is_not_a_non_negative_integer(version: object) -> None:
    with pytest.raises(
        CacheKeyError,
        match="Cache user_profile: version given to bump\\(\\) must be a non-negative integer",
    ) as caught:
        profiles().bump(version, user_id=1)
    assert caught.value.field == "version"


def test_field_values_that_are_accepted() -> None:
    cache = profiles()
    template = cache._template
    assert template.render({"user_id": 42}) == "user_profile:42"
    assert profiles("site_settings:current")._template.render({}) == "site_settings:current"
    assert template.render({"user_id": -1}) == "user_profile:-1"
    assert template.render({"user_id": "ada@example.com"}) == "user_profile:ada@example.com"
    u = uuid.UUID(int=7)
    assert template.render({"user_id": u}) == f"user_profile:{u}"
