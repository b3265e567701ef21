"""Keys: the business identity of an effect, rendered from a task's arguments.

A key like ``payment:{payment_id}:capture`` names *the effect*, not the message: a retry,
a redelivery or a replay of the same capture renders the same key, so the effect ledger
(``django_outbox.store.ledger``) can apply it once. A key must therefore be built only from
arguments that identify the business operation, never from a task id, a timestamp or a
random value; that is why template fields must be parameters of ``run()``.

The fingerprint covers *all* arguments: the same key arriving with other arguments
(another amount for the same payment) is a conflict an operator must see.

Dedup and ordering keys are rendered here too, by the same rules. The headers that
carry a rendered key with the message are ``celery_explicit.headers``'.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import string
from collections.abc import Callable, Mapping
from typing import Any

from celery_explicit.errors import BadInput

MAX_KEY_LENGTH = 255

KeyDeclaration = str | Callable[..., str]


#: The filter a template field may end with: ``{card|sha256}`` renders the value's
#: SHA-256 (64 hex digits of ``str(value)`` in UTF-8) instead of the value. The whole
#: digest, not a prefix: a key is the effect's identity, and two values that shared a
#: truncated digest would be one effect; 64 characters fit well under MAX_KEY_LENGTH.
HASH_FILTER = "|sha256"


@functools.lru_cache(maxsize=1024)
def template_fields(template: str) -> tuple[str, ...]:
    """Root names of the fields in a ``str.format`` template (``{order.id}`` -> ``order``,
    ``{card|sha256}`` -> ``card``)."""
    # Kept per template: every publish and every delivery renders a key, and a
    # template is one of the few each task declares (parsing it again cost a job
    # about 110 Python opcodes, bench/opcodes_per_job.py). A template refused with
    # ValueError is not kept.
    return tuple(root for root, _hashed in template_field_uses(template))


@functools.lru_cache(maxsize=1024)
def template_field_uses(template: str) -> tuple[tuple[str, bool], ...]:
    """Each field of a template: its root name, and whether it is hashed (``|sha256``)."""
    uses: list[tuple[str, bool]] = []
    for _literal, field, _spec, _conv in string.Formatter().parse(template):
        if field is None:
            continue
        hashed = field.endswith(HASH_FILTER)
        path = field.removesuffix(HASH_FILTER)
        root = path.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise ValueError(
                f"positional field {{{field}}} in {template!r}: name the run() parameter"
            )
        if "|" in path:
            raise ValueError(
                f"field {{{field}}} in {template!r}: the only filter is {HASH_FILTER} "
                f"({{{root}{HASH_FILTER}}})"
            )
        uses.append((root, hashed))
    return tuple(uses)


def digest(value: Any) -> str:
    """What ``{field|sha256}`` renders: the SHA-256 of ``str(value)``, in hex."""
    return hashlib.sha256(str(value).encode()).hexdigest()


class _KeyFormatter(string.Formatter):
    """``str.format`` with the ``|sha256`` filter: the one renderer of key templates
    (idempotency, dedup and ordering keys, their earlier templates)."""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> Any:
        if field_name.endswith(HASH_FILTER):
            value, root = super().get_field(field_name.removesuffix(HASH_FILTER), args, kwargs)
            return digest(value), root
        return super().get_field(field_name, args, kwargs)


_FORMATTER = _KeyFormatter()


def callable_fields(key: Callable[..., str]) -> tuple[list[str], bool]:
    """Parameter names a key callable takes, and whether it accepts ``**kwargs``."""
    params = inspect.signature(key).parameters.values()
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def render_key(
    task_name: str,
    declaration: KeyDeclaration,
    given: Mapping[str, Any],
    *,
    label: str = "idempotency key",
) -> str:
    """Render the key from the arguments the caller *gave* (defaults are not identity).

    Raises ``BadInput`` naming the task and the field when a field is missing or None:
    ``payment:None:capture`` would merge every payment without an id into one effect.
    """
    if callable(declaration):
        names, takes_kwargs = callable_fields(declaration)
        wanted = given if takes_kwargs else {n: given[n] for n in names if n in given}
        for name in names:
            if name not in given and not takes_kwargs:
                raise BadInput(task_name, f"{label} field {name!r} is missing from the arguments")
            if given.get(name, "") is None:
                raise BadInput(task_name, f"{label} field {name!r} is None")
        try:
            key = declaration(**wanted)
        except Exception as exc:  # the user's callable: any failure is this message's input
            raise BadInput(task_name, f"{label} callable failed: {exc!r}") from exc
        if not isinstance(key, str) or not key:
            raise BadInput(task_name, f"{label} callable returned {key!r}, not a non-empty string")
    else:
        for field in template_fields(declaration):
            if field not in given:
                raise BadInput(
                    task_name,
                    f"{label} field {field!r} is missing from the arguments (key {declaration!r})",
                )
            if given[field] is None:
                raise BadInput(task_name, f"{label} field {field!r} is None (key {declaration!r})")
        try:
            key = (
                _FORMATTER.vformat(declaration, (), dict(given))
                if HASH_FILTER in declaration
                else declaration.format(**given)  # str.format is C: the usual key
            )
        except Exception as exc:  # {order[id]} on a list, {n[0]} on an int, ...
            raise BadInput(task_name, f"cannot render {label} {declaration!r}: {exc!r}") from exc
    if len(key) > MAX_KEY_LENGTH:
        raise BadInput(
            task_name,
            f"{label} is {len(key)} characters, longer than {MAX_KEY_LENGTH}: {key[:40]!r}...",
        )
    return key


def fingerprint(arguments: Mapping[str, Any]) -> str:
    """A stable hash of the call's arguments (JSON, sorted keys; defaults included).

    The ledger rows written before ``identity_fingerprint`` carry this one; it is
    still accepted as the same call."""
    return hashlib.sha256(_CANONICAL.encode(arguments).encode()).hexdigest()


def identity_arguments(
    arguments: Mapping[str, Any], signature: inspect.Signature
) -> dict[str, Any]:
    """A call's arguments without those equal to their default (see
    ``identity_fingerprint``)."""
    params = signature.parameters
    return {
        name: value
        for name, value in arguments.items()
        if name not in params
        or params[name].default is inspect.Parameter.empty
        or not _same(value, params[name].default)
    }


def identity_fingerprint(arguments: Mapping[str, Any], signature: inspect.Signature) -> str:
    """The fingerprint of a call without the arguments equal to their default.

    ``f(ref)`` and ``f(ref, amount=10)`` with ``amount=10`` the default are one call,
    and a parameter added to ``run()`` with a default leaves the fingerprint of every
    call that does not pass it unchanged: a job applied before such a deploy and
    delivered again after it is a duplicate, not a conflict.
    """
    return fingerprint(identity_arguments(arguments, signature))


def _same(value: Any, default: Any) -> bool:
    try:
        return bool(value == default) and type(value) is type(default)
    except Exception:  # an argument type whose comparison fails is not its default
        return False


#: ``json.dumps(..., sort_keys=True, separators=(",", ":"), default=str)``, made once
#: (``json.dumps`` with options builds an encoder per call).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=str)
