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
- in dead letters of every reason, whoever writes them (the job path, the worker's
  main process after a hard time limit, the relay, the reconciler): their arguments,
  raw body, error and traceback (``for_task``, applied by ``django_outbox.store.dead_letters``);
- in attempt rows' error text and our log lines;
- in what Celery logs and stores for a retry (``Task ... retry: Retry in 2s: ...``,
  the RETRY state): the error handed to ``retry()`` is a scrubbed copy (``error``);
- in the result backend: the arguments stored with ``result_extended``, by the task
  (``ExplicitTask.__call__``) and by the main process (``ExplicitRequest``);
- in the admin's views of outbox rows (the row itself keeps them: the relay publishes
  from it).

The message itself, and the handler, get the real values: redaction is about what
we show and keep as evidence, not about transport (encrypt the broker for that).
A declared name that is not one of ``run()``'s parameters is refused when the class
is created, naming the task and the field, and so is a key template that would show
a declared field in the clear (``{card}``): keys are logged, sent in headers, used in
Redis key names and shown by the admin and ``explain``. ``{card|sha256}`` keys by the
value's SHA-256 digest instead (``celery_explicit.keys``).

``Redaction`` (built by ``of_call`` or ``for_task``) is the one place that decides
what a call may show; every writer of evidence goes through it.
"""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
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


def _written_forms(value: Any) -> list[str]:
    """The text forms of a value as it may appear in evidence: ``str`` (an error
    message), and JSON (a raw message body), quotes stripped for a string."""
    forms = [str(value)]
    try:
        encoded = json.dumps(value, default=str)
    except (TypeError, ValueError, RecursionError):
        return forms
    forms.append(encoded[1:-1] if isinstance(value, str) else encoded)
    return forms


@dataclass(frozen=True)
class Redaction:
    """What one call of a task may show: its sensitive fields replaced in its
    arguments, and their values scrubbed from any text about it.

    Built by ``of_call`` (a task whose contract is at hand) or ``for_task`` (by
    name); ``NONE`` for a task with nothing to hide, where every method is the
    identity.
    """

    fields: tuple[str, ...] = ()
    signature: inspect.Signature | None = None
    #: The text forms of the fields' values in this call (``MIN_SCRUB_LENGTH``).
    secrets: tuple[str, ...] = ()

    def arguments(
        self, args: Iterable[Any], kwargs: Mapping[str, Any]
    ) -> tuple[list[Any], dict[str, Any]]:
        """``args`` and ``kwargs`` as they may be shown or kept."""
        if not self.fields:
            return list(args), dict(kwargs)
        if self.signature is None:
            # No signature (a task this process does not know): by name only.
            return list(args), {k: (REDACTED if k in self.fields else v) for k, v in kwargs.items()}
        return redact(self.fields, self.signature, args, kwargs)

    def text(self, text: str) -> str:
        """``text`` with the call's sensitive values replaced."""
        return scrub(text, self.secrets) if self.secrets else text

    def error(self, exc: BaseException) -> BaseException:
        """``exc`` itself when its text quotes no sensitive value, else a copy whose
        ``args`` are scrubbed: for whoever shows or keeps the error (Celery's retry
        line and RETRY state), while the raised one stays as the handler made it."""
        if not self.secrets or not self._quoted_in(exc):
            return exc
        try:
            shown = copy.copy(exc)
            shown.args = tuple(self.text(a) if isinstance(a, str) else a for a in exc.args)
        except Exception:  # an error class that cannot be copied: described instead
            shown = None
        if shown is None or self._quoted_in(shown):
            # Its text is not (only) its args (a __str__ of its own): a plain error
            # with the scrubbed description stands in.
            return Exception(
                f"{type(exc).__module__}.{type(exc).__qualname__}: {self.text(str(exc))}"
            )
        return shown

    def _quoted_in(self, exc: BaseException) -> bool:
        try:
            said = f"{exc}{exc!r}"
        except Exception:  # an error whose __str__ fails quotes nothing we can see
            return False
        return any(secret in said for secret in self.secrets)


NONE = Redaction()


def of_call(
    fields: Iterable[str],
    signature: inspect.Signature | None,
    args: Iterable[Any],
    kwargs: Mapping[str, Any],
) -> Redaction:
    """The redaction of one call of a task declaring ``fields`` sensitive."""
    fields = tuple(fields)
    if not fields:
        return NONE
    args, kwargs = list(args), dict(kwargs)
    shown_args, shown_kwargs = (
        redact(fields, signature, args, kwargs)
        if signature is not None
        else (args, {k: (REDACTED if k in fields else v) for k, v in kwargs.items()})
    )
    values = [v for v, s in zip(args, shown_args, strict=False) if s == REDACTED and v != REDACTED]
    values += [
        kwargs[k] for k, s in shown_kwargs.items() if s == REDACTED and kwargs[k] != REDACTED
    ]
    secrets = {form for value in values for form in _written_forms(value)}
    return Redaction(
        fields=fields,
        signature=signature,
        secrets=tuple(sorted(s for s in secrets if len(s) >= MIN_SCRUB_LENGTH)),
    )


def for_task(task_name: str, app: Any, args: Any, kwargs: Any) -> Redaction:
    """The redaction of one call of the registered task ``task_name`` (``NONE`` for a
    task that is not an ExplicitTask, is not registered here or declares nothing).
    Arguments of the wrong shape (a malformed message) are taken as none."""
    signature, fields = of_task(task_name, app)
    if not fields:
        return NONE
    return of_call(
        fields,
        signature,
        args if isinstance(args, list | tuple) else (),
        kwargs if isinstance(kwargs, Mapping) else {},
    )


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
