"""Sensitive payload fields: declared on the task, never shown or kept in the clear.

A task declares the ``run()`` parameters that carry secrets or personal data::

    class CapturePayment(ExplicitTask):
        sensitive = ("card_number",)

Declared fields are replaced by ``[redacted]``

- in what Celery logs and sends in events (``argsrepr`` / ``kwargsrepr``, set at
  publish: Celery's own "Task ... received" lines, Flower, ``celery events``);
- in dead letters: their arguments are stored redacted, and the fields' values are
  scrubbed from the stored error message and traceback (an exception often quotes
  its input). Such a letter cannot be replayed: its arguments are gone, and the
  confirmation page says so;
- in the admin's views of outbox rows (the row itself keeps them: the relay publishes
  from it).

The message itself, and the handler, get the real values: redaction is about what
we show and keep as evidence, not about transport (encrypt the broker for that).
A declared name that is not one of ``run()``'s parameters is refused when the class
is created, naming the task and the field.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

#: ``declarations.Refuse``: builds the ContractError naming the task (not imported:
#: this module sits below the declarations, beside ``execution`` which uses it).
Refuse = Callable[[str, str], Exception]

#: What a sensitive value is replaced with, wherever it is shown or kept.
REDACTED = "[redacted]"

#: Values shorter than this are not scrubbed from free text (an id like "7" would
#: blank out every 7 in a traceback); their fields are still redacted.
MIN_SCRUB_LENGTH = 4


def declared(
    cls: type, params: tuple[str, ...], takes_kwargs: bool, refuse: Refuse
) -> tuple[str, ...]:
    """The task's ``sensitive`` declaration, validated against ``run()``'s parameters."""
    raw = getattr(cls, "sensitive", ())
    if isinstance(raw, str):
        raw = (raw,)
    if not isinstance(raw, tuple | list | frozenset | set) or not all(
        isinstance(f, str) and f for f in raw
    ):
        raise refuse(
            f"sensitive={raw!r} must be a tuple of run() parameter names, e.g. "
            "sensitive = ('card_number',)",
            "sensitive",
        )
    for field in raw:
        if field not in params and not takes_kwargs:
            raise refuse(
                f"sensitive names {field!r}, which is not a parameter of run() "
                f"(parameters: {', '.join(params) or 'none'})",
                "sensitive",
            )
    return tuple(sorted(set(raw)))


def redact(
    fields: Iterable[str],
    signature: inspect.Signature,
    args: Iterable[Any],
    kwargs: Mapping[str, Any],
) -> tuple[list[Any], dict[str, Any]]:
    """``args`` and ``kwargs`` with every declared field's value replaced.

    Positional arguments are matched to ``run()``'s parameters by position.
    """
    names = set(fields)
    positional = [
        p.name
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    new_args = [
        REDACTED if i < len(positional) and positional[i] in names else value
        for i, value in enumerate(args)
    ]
    new_kwargs = {k: (REDACTED if k in names else v) for k, v in kwargs.items()}
    return new_args, new_kwargs


def values_of(
    fields: Iterable[str],
    signature: inspect.Signature,
    args: Iterable[Any],
    kwargs: Mapping[str, Any],
) -> list[str]:
    """The string forms of the declared fields' values, for scrubbing free text."""
    redacted_args, redacted_kwargs = redact(fields, signature, args, kwargs)
    found = [
        str(value)
        for value, shown in zip(args, redacted_args, strict=False)
        if shown == REDACTED and value != REDACTED
    ]
    found += [str(kwargs[k]) for k, v in redacted_kwargs.items() if v == REDACTED]
    return [v for v in found if len(v) >= MIN_SCRUB_LENGTH]


def scrub(text: str, values: Iterable[str]) -> str:
    """``text`` with each value (and its ``repr``) replaced, longest first."""
    for value in sorted(set(values), key=len, reverse=True):
        text = text.replace(repr(value), REDACTED).replace(value, REDACTED)
    return text


def holds_redacted(args: Iterable[Any], kwargs: Mapping[str, Any]) -> list[str]:
    """Where stored arguments were redacted (``#0``, ``card_number``): a replay of
    them would run with ``[redacted]`` in place of the value."""
    places = [f"#{i}" for i, v in enumerate(args) if v == REDACTED]
    return places + [k for k, v in kwargs.items() if v == REDACTED]


def of_task(task_name: str, app: Any) -> tuple[Any, tuple[str, ...]]:
    """The registered task's contract signature and its sensitive fields (none for a
    task that is not an ExplicitTask or is not registered)."""
    task = app.tasks.get(task_name) if app is not None else None
    contract = getattr(task, "contract", None)
    if contract is None:
        return None, ()
    return contract.signature, contract.sensitive
