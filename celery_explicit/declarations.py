"""Reading one declaration off a task class, and refusing it with the field's name.

The helpers every mechanism uses to validate its own options (``dedup``, ``ordering``,
``delivery_limit`` and the core in ``contract``): a key declaration (a template over
``run()``'s parameters, or a callable), its fields, a positive duration. Each raises
``ContractError`` through the ``refuse`` callable it is given, which names the task.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from celery_explicit import keys
from celery_explicit.errors import ContractError

#: Builds the error for one field: ``refuse(message, field)``.
Refuse = Callable[[str, str], ContractError]


def key_declaration(
    cls: type,
    attr: str = "idempotency_key",
    example: str = "'payment:{payment_id}:capture'",
    *,
    task_name: str = "",
) -> keys.KeyDeclaration:
    # Read through the MRO's __dict__: a function stored on the class would otherwise
    # come back as a bound method and take the task as its first argument.
    for klass in cls.__mro__:
        if attr in klass.__dict__:
            raw = klass.__dict__[attr]
            if isinstance(raw, staticmethod):
                raw = raw.__func__
            if isinstance(raw, str) or callable(raw):
                return raw  # type: ignore[no-any-return]
            break
    raise ContractError(
        task_name or f"{cls.__module__}.{cls.__qualname__}",
        f"{attr} must be a template string like {example} or a callable",
        field=attr,
    )


def check_key_fields(
    key: keys.KeyDeclaration,
    params: tuple[str, ...],
    takes_kwargs: bool,
    refuse: Refuse,
    attr: str = "idempotency_key",
) -> None:
    if isinstance(key, str):
        if not key.strip():
            raise refuse(f"{attr} is empty", attr)
        try:
            fields = keys.template_fields(key)
        except ValueError as exc:
            raise refuse(f"{attr} {key!r}: {exc}", attr) from None
        if not fields:
            raise refuse(
                f"{attr} {key!r} has no field: every message would "
                "share one key; build it from the business identity, e.g. "
                "'payment:{payment_id}:capture'",
                attr,
            )
    else:
        names, key_takes_kwargs = keys.callable_fields(key)
        fields = tuple(names)
        if key_takes_kwargs and not fields:
            return
        if not fields:
            raise refuse(
                f"{attr} callable takes no parameter: every message would share one key; "
                "take the run() parameters that identify the operation",
                attr,
            )
    unknown = [f for f in fields if f not in params]
    if unknown and not takes_kwargs:
        raise refuse(
            f"{attr} field {unknown[0]!r} is not a parameter of run() "
            f"(parameters: {', '.join(params) or 'none'})",
            attr,
        )


def shown_in_key(key: keys.KeyDeclaration, sensitive: tuple[str, ...]) -> str | None:
    """The first sensitive field ``key`` would show in the clear, if any: a template
    field without ``|sha256``, or a parameter of a key callable (whatever it does with
    the value, we cannot see that it hashes it)."""
    if not sensitive:
        return None
    if isinstance(key, str):
        for root, hashed in keys.template_field_uses(key):
            if root in sensitive and not hashed:
                return root
        return None
    names, _takes_kwargs = keys.callable_fields(key)
    return next((name for name in names if name in sensitive), None)


def positive(value: object, field: str, refuse: Refuse) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise refuse(f"{field}={value!r} must be a positive, finite number of seconds", field)
    return float(value)


def task_name(cls: type) -> str:
    return str(getattr(cls, "name", None) or f"{cls.__module__}.{cls.__qualname__}")


def key_with_duration(
    cls: type,
    params: tuple[str, ...],
    takes_kwargs: bool,
    refuse: Refuse,
    *,
    key_attr: str,
    duration_attr: str,
    example: str,
    without_key: str,
) -> tuple[keys.KeyDeclaration, float | None] | None:
    """A key declared with a duration beside it (``dedup_key`` + ``dedup_window``,
    ``ordering_key`` + ``ordering_gap``): None when neither is declared; the duration
    without its key is refused (``without_key`` says what to declare)."""
    declared_key = getattr(cls, key_attr, None)
    duration = getattr(cls, duration_attr, None)
    if declared_key is None:
        if duration is not None:
            raise refuse(
                f"{duration_attr} is declared without {key_attr}: {without_key}", duration_attr
            )
        return None
    key = key_declaration(cls, key_attr, example, task_name=task_name(cls))
    check_key_fields(key, params, takes_kwargs, refuse, key_attr)
    return key, None if duration is None else positive(duration, duration_attr, refuse)
