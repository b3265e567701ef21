"""Key templates of django_outbox.cache.versioned: one key per entity, never two, never shared.

A template such as ``"user_profile:{user_id}"`` is parsed once, when the cache is
declared, and every call renders it from the fields given by name. Whatever could make
two spellings of one row into two keys (a format spec, a bool or a float field), or
two rows into one key (a ``None``, an empty string, a ``:`` inside a field), is refused
with an error naming the cache and the field, before Redis is touched.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any, NoReturn
from uuid import UUID

from django_outbox.errors import CacheConfigError, CacheKeyError

__all__ = ["FieldValue", "KeyTemplate", "base_key"]

#: What a key field may hold. Not bool or float (True, 1.0 and 1 are equal in Python but
#: would be three keys for one row), never None (every missing id would share one key).
FieldValue = int | str | UUID


class KeyTemplate:
    """A parsed key template: the entity's name (up to the first ':') and its fields."""

    def __init__(self, template: str, *, versioned: bool) -> None:
        # The template names the entity; the helpers append ":ver" or ":lease" to it.
        name = template.split(":", 1)[0] if isinstance(template, str) else ""
        if not name or "{" in name or ":" not in template:
            raise CacheConfigError(
                str(template),
                None,
                f"key template {template!r} must start with a literal name and a colon, "
                "e.g. 'user_profile:{user_id}'",
            )
        self.name = name
        self.template = template
        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as exc:  # an unmatched brace
            raise CacheConfigError(name, None, f"key template {template!r}: {exc}") from exc
        fields: list[str] = []
        for _literal, field, spec, conversion in parsed:
            if field is None:
                continue
            if not field.isidentifier():
                raise CacheConfigError(
                    name,
                    field or None,
                    f"field {{{field}}} in {template!r} must be a plain name: no positional "
                    "fields, attributes or indexes (the caller passes each field by name)",
                )
            if spec or conversion:
                raise CacheConfigError(
                    name,
                    field,
                    f"field {{{field}}} in {template!r} has a format spec or conversion: "
                    "two spellings of one value would be two keys for one row",
                )
            if field == "using":
                raise CacheConfigError(
                    name, field, "'using' is reserved (the cache's database option)"
                )
            fields.append(field)
        if "version" in fields:
            hint = (
                "the version is stored with the value, not in the key (one GET per read)"
                if versioned
                else "use VersionedCache, which takes the version from the source"
            )
            raise CacheConfigError(
                name, "version", f"key template {template!r} has a {{version}} field: {hint}"
            )
        self.fields = frozenset(fields)

    def render(self, given: Mapping[str, object]) -> str:
        """The entity's key (before the cache's prefix); ``CacheKeyError`` naming the field
        that does not fit."""
        if given.keys() != self.fields:
            self._mismatch(given)
        for field, value in given.items():
            if type(value) is int or isinstance(value, UUID):
                continue
            if isinstance(value, str) and value and ":" not in value:
                continue
            self._bad_value(field, value)
        return self.template.format_map(given)

    def check_version(self, version: object, origin: str) -> int:
        if type(version) is not int or version < 0:
            raise CacheKeyError(
                self.name,
                "version",
                f"version {origin} must be a non-negative integer, got {version!r}",
            )
        return version

    def _mismatch(self, given: Mapping[str, object]) -> NoReturn:
        if "version" in given:
            raise CacheKeyError(
                self.name,
                "version",
                "the version is not a key field: reads take it from the cache or the "
                "source, bump() takes it as its first argument",
            )
        missing = sorted(self.fields - given.keys())
        if missing:
            raise CacheKeyError(
                self.name, missing[0], f"field {missing[0]!r} is missing (key {self.template!r})"
            )
        unknown = sorted(given.keys() - self.fields)[0]
        raise CacheKeyError(
            self.name,
            unknown,
            f"field {unknown!r} is not in the key {self.template!r} "
            f"(its fields: {', '.join(sorted(self.fields)) or 'none'})",
        )

    def _bad_value(self, field: str, value: object) -> NoReturn:
        if value is None:
            problem = "is None"
        elif isinstance(value, str):
            # "a:{x}:{y}" with x="1:2", y="3" and x="1", y="2:3" would be one key.
            problem = "is empty" if not value else f"contains ':' ({value!r})"
        else:
            problem = f"is a {type(value).__name__} ({value!r}), not an int, str or UUID"
        raise CacheKeyError(self.name, field, f"field {field!r} {problem} (key {self.template!r})")


def base_key(client: Any, name: str, identity: str) -> str:
    """The Redis key of an entity: the rendered template under the cache's prefix."""
    base: str = client.make_key(identity)  # a CacheKey: a str
    # ":ver" and ":lease" are appended to the made key; a KEY_FUNCTION that hashes or
    # reorders the key would put them somewhere else.
    if not base.endswith(identity):
        raise CacheConfigError(
            name, "cache", "the cache's KEY_FUNCTION must end the Redis key with the key given"
        )
    return base
