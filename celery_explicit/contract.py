"""The contract a task declares, and its validation when the task class is created.

Every ExplicitTask states, on the task itself: the idempotency key of its effect, the
lease on its message (``visibility_timeout``) beside how long a normal run takes
(``expected_duration``), and which errors retry and which are permanent. A missing or
contradictory declaration is refused here, naming the task and the field, so it fails
when the code is imported (or when Celery finalizes the app for decorator-declared
tasks; ``manage.py check`` and worker start-up force that), never at 3 a.m.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery import Task

from celery_explicit import arguments, cancellation, declarations, keys
from celery_explicit import dedup as dedup_mod
from celery_explicit import ordering as ordering_mod
from celery_explicit import periodic as periodic_mod
from celery_explicit import rate_limit as rate_limit_mod
from celery_explicit import sensitive as sensitive_mod
from celery_explicit.downstream import Downstream
from celery_explicit.errors import ContractError
from celery_explicit.retry_policy import RetryPolicy, Unclassified

#: A lease must cover at least this multiple of a normal run: a run twice as slow as
#: usual (a slow downstream, a GC pause) must still not be handed to a second worker.
SAFE_MARGIN_FACTOR = 2.0

REQUIRED = ("idempotency_key", "visibility_timeout", "expected_duration", "retry_on", "fail_on")

DEFAULTS: Mapping[str, Any] = {
    "dedup_key": None,
    "dedup_window": None,
    "unclassified": Unclassified.PERMANENT,
    "max_attempts": 5,
    "backoff_base": 1.0,
    "backoff_cap": 60.0,
    "max_deliveries": 5,
    "max_run_time": None,
    "downstream": None,
    "ordering_key": None,
    "ordering_gap": None,
    "sensitive": (),
    "cancellable": False,
    "periodic": False,
    "rate_limit": None,
}

#: Celery options that would quietly undo a contract, with what to declare instead.
REFUSED_CELERY_OPTIONS: Mapping[str, str] = {
    "autoretry_for": "declare retry_on / fail_on instead",
    "retry_backoff": "declare backoff_base instead",
    "retry_backoff_max": "declare backoff_cap instead",
    "retry_jitter": "ExplicitTask always uses full jitter",
    "retry_kwargs": "declare max_attempts / backoff_base / backoff_cap instead",
    "default_retry_delay": "declare backoff_base instead",
}

#: Celery options an ExplicitTask fixes, and the only value it accepts.
FIXED_CELERY_OPTIONS: Mapping[str, tuple[object, str]] = {
    "acks_late": (True, "the message is acknowledged only after the handler finished"),
    "reject_on_worker_lost": (True, "a job whose worker died must be delivered again"),
    "serializer": ("json", "a pickled message from the broker is code execution"),
    # Celery's own retry limit would end a job on its 4th retry by re-raising the error
    # (not retried, not dead-lettered): ExplicitTask turns it off.
    "max_retries": (None, "attempts are counted by max_attempts: declare that instead"),
}


@functools.cache
def celery_decorator_keys() -> frozenset[str]:
    """The keys Celery's ``@app.task`` itself puts in a task's class dict, read off
    Celery by declaring a throwaway task on a throwaway app.

    ``Celery._task_from_fun`` builds the class with ``type(name, (base,), {...})``
    (celery/app/base.py: https://github.com/celery/celery/blob/main/celery/app/base.py);
    a copied list of those keys would refuse every decorator task the day upstream adds
    one. Whatever is in the dict besides the decorator's own options is Celery's.
    """
    from celery import Celery

    seen: dict[str, Any] = {}

    class Probe(Task):  # type: ignore[type-arg]
        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            seen.update(cls.__dict__)

    def probe() -> None:
        return None

    app = Celery("celery_explicit_probe", set_as_current=False)
    app.task(base=Probe, name="celery_explicit.probe", lazy=False)(probe)
    return frozenset(seen)


_CELERY_TASK_ATTRS = frozenset(dir(Task))


@dataclass(frozen=True)
class Contract:
    """What a task declared, normalized. ``task.contract`` holds one per task class."""

    task_name: str
    idempotency_key: keys.KeyDeclaration
    visibility_timeout: float
    expected_duration: float
    retry: RetryPolicy
    run_parameters: tuple[str, ...]
    run_takes_kwargs: bool
    #: ``run()``'s signature without ``self``: arguments are bound to it at publish
    #: and again in the worker.
    signature: inspect.Signature
    #: Explicit dedup of a known message id inside a window (None: not declared).
    dedup: dedup_mod.Dedup | None = None
    #: Deliveries of one message (redeliveries included) before it is dead-lettered.
    max_deliveries: int = 5
    #: Seconds a run may take before it is stopped (None: no limit declared).
    max_run_time: float | None = None
    #: The dependency this task calls, with its shared limits (None: not declared).
    downstream: Downstream | None = None
    #: Per-entity ordering: jobs with one rendered key run one at a time, in publish
    #: order (None: not declared).
    ordering: ordering_mod.Ordering | None = None
    #: run() parameters never shown or kept in the clear (``celery_explicit.sensitive``).
    sensitive: tuple[str, ...] = ()
    #: ``signature``'s fast binding (``celery_explicit.arguments``).
    binder: arguments.Binder = arguments.INSPECT_ONLY
    #: An operator may cancel its jobs (``celery_explicit.cancellation``).
    cancellable: bool = False
    #: Published by a beat once per schedule slot, passed as ``slot``
    #: (``celery_explicit.periodic``).
    periodic: bool = False
    #: Starts per period per rendered key, across every worker (None: not declared).
    rate_limit: rate_limit_mod.RateLimit | None = None


def declared_names() -> frozenset[str]:
    return frozenset(REQUIRED) | frozenset(DEFAULTS)


def run_signature(cls: type) -> tuple[inspect.Signature, bool]:
    """``run()``'s signature without ``self``, and whether it binds ``self``."""
    for klass in cls.__mro__:
        raw = klass.__dict__.get("run")
        if raw is None:
            continue
        if isinstance(raw, staticmethod):
            return inspect.signature(raw.__func__), False
        sig = inspect.signature(raw)
        params = list(sig.parameters.values())[1:]
        return sig.replace(parameters=params), True
    raise TypeError(f"{cls!r} has no run()")


def build(cls: type, namespace: Mapping[str, Any]) -> Contract:
    """Validate ``cls``'s declarations; raise ContractError naming the task and field."""
    name = str(getattr(cls, "name", None) or f"{cls.__module__}.{cls.__qualname__}")

    def refuse(message: str, field: str) -> ContractError:
        return ContractError(name, message, field=field)

    # Before the unknown-option check: a decorator's autoretry_for= gets the same
    # message (what to declare instead) as a class attribute does.
    # Checked along the MRO: an abstract base must not smuggle them in either.
    for option, hint in REFUSED_CELERY_OPTIONS.items():
        if any(option in k.__dict__ for k in cls.__mro__ if not _is_celery_class(k)):
            raise refuse(f"option {option!r} is not used by ExplicitTask: {hint}", option)
    _refuse_unknown_options(name, namespace, refuse)
    for option, (value, why) in FIXED_CELERY_OPTIONS.items():
        actual = getattr(cls, option, value)
        if actual != value:
            raise refuse(
                f"{option}={actual!r} is refused; ExplicitTask needs {option}={value!r}: {why}",
                option,
            )

    sig, _ = run_signature(cls)
    declared = {field: getattr(cls, field, None) for field in REQUIRED}
    missing = [field for field, value in declared.items() if value is None]
    if missing:
        example = _example(missing[0], name, sig)
        raise ContractError(
            name,
            f"missing declaration {missing[0]!r} (every ExplicitTask declares "
            f"{', '.join(REQUIRED)}); for example {example}",
            field=missing[0],
            hint=f"Declare it on the task: {example}",
        )

    params = tuple(
        p.name
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    )
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())

    key = declarations.key_declaration(cls, task_name=name)
    declarations.check_key_fields(key, params, takes_kwargs, refuse)

    visibility = declarations.positive(declared["visibility_timeout"], "visibility_timeout", refuse)
    expected = declarations.positive(declared["expected_duration"], "expected_duration", refuse)
    if visibility < expected * SAFE_MARGIN_FACTOR:
        raise refuse(
            f"visibility_timeout={visibility:g}s leaves no safe margin over "
            f"expected_duration={expected:g}s: declare at least "
            f"{expected * SAFE_MARGIN_FACTOR:g}s ({SAFE_MARGIN_FACTOR:g}x), or a second "
            "worker may take the job while the first still runs",
            "visibility_timeout",
        )

    retry_on = _exception_classes(declared["retry_on"], "retry_on", refuse)
    fail_on = _exception_classes(declared["fail_on"], "fail_on", refuse)
    both = [k.__name__ for k in retry_on if k in fail_on]
    if both:
        raise refuse(
            f"{both[0]} is declared both retryable (retry_on) and permanent (fail_on): pick one",
            "fail_on",
        )

    raw_unclassified = getattr(cls, "unclassified", DEFAULTS["unclassified"])
    try:
        unclassified = Unclassified(getattr(raw_unclassified, "value", raw_unclassified))
    except ValueError:
        raise refuse(
            f"unclassified={raw_unclassified!r}: choose 'permanent' or 'retry'", "unclassified"
        ) from None

    max_attempts = getattr(cls, "max_attempts", DEFAULTS["max_attempts"])
    if not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1:
        raise refuse(
            f"max_attempts={max_attempts!r} must be an integer >= 1 (it counts the first attempt)",
            "max_attempts",
        )
    max_deliveries = getattr(cls, "max_deliveries", DEFAULTS["max_deliveries"])
    if (
        not isinstance(max_deliveries, int)
        or isinstance(max_deliveries, bool)
        or max_deliveries < 1
    ):
        raise refuse(
            f"max_deliveries={max_deliveries!r} must be an integer >= 1 (deliveries of one "
            "message, redeliveries included)",
            "max_deliveries",
        )
    max_run_time: float | None = None
    if getattr(cls, "max_run_time", None) is not None:
        max_run_time = declarations.positive(
            getattr(cls, "max_run_time", None), "max_run_time", refuse
        )
        if max_run_time < expected:
            raise refuse(
                f"max_run_time={max_run_time:g}s is shorter than expected_duration="
                f"{expected:g}s: a normal run would be stopped",
                "max_run_time",
            )
    downstream = getattr(cls, "downstream", None)
    if downstream is not None and not isinstance(downstream, Downstream):
        raise refuse(
            f"downstream={downstream!r} must be a celery_explicit.Downstream "
            "(name, concurrency, failure_threshold, cool_down), shared by the tasks "
            "that call it",
            "downstream",
        )
    base = declarations.positive(
        getattr(cls, "backoff_base", DEFAULTS["backoff_base"]), "backoff_base", refuse
    )
    cap = declarations.positive(
        getattr(cls, "backoff_cap", DEFAULTS["backoff_cap"]), "backoff_cap", refuse
    )
    if cap < base:
        raise refuse(f"backoff_cap={cap:g}s is below backoff_base={base:g}s", "backoff_cap")

    contract = Contract(
        task_name=name,
        idempotency_key=key,
        visibility_timeout=visibility,
        expected_duration=expected,
        retry=RetryPolicy(
            retry_on=retry_on,
            fail_on=fail_on,
            unclassified=unclassified,
            max_attempts=max_attempts,
            backoff_base=base,
            backoff_cap=cap,
        ),
        run_parameters=params,
        run_takes_kwargs=takes_kwargs,
        signature=sig,
        binder=arguments.Binder.of(sig),
        dedup=dedup_mod.declared(cls, params, takes_kwargs, refuse),
        max_deliveries=max_deliveries,
        max_run_time=max_run_time,
        downstream=downstream,
        ordering=ordering_mod.declared(cls, params, takes_kwargs, refuse, visibility, cap),
        sensitive=sensitive_mod.declared(cls, params, takes_kwargs, refuse),
        cancellable=cancellation.declared(cls, refuse),
        periodic=periodic_mod.declared(cls, params, takes_kwargs, refuse),
        rate_limit=rate_limit_mod.declared(cls, params, takes_kwargs, refuse),
    )
    _refuse_sensitive_keys(contract)
    return contract


def _refuse_sensitive_keys(contract: Contract) -> None:
    """A key is shown everywhere (log lines, message headers, Redis key names, the
    admin, ``explain``): a sensitive field may enter it only hashed."""
    declared: list[tuple[str, keys.KeyDeclaration]] = [
        ("idempotency_key", contract.idempotency_key)
    ]
    if contract.dedup is not None:
        declared.append(("dedup_key", contract.dedup.key))
    if contract.ordering is not None:
        declared.append(("ordering_key", contract.ordering.key))
    if contract.rate_limit is not None:
        declared.append(("rate_limit", contract.rate_limit.key))
    for attr, key in declared:
        field = declarations.shown_in_key(key, contract.sensitive)
        if field is None:
            continue
        hashed = f"{{{field}{keys.HASH_FILTER}}}"
        raise ContractError(
            contract.task_name,
            f"{attr} {key!r} shows the sensitive field {field!r} in the clear; keys are "
            "logged, sent in headers, used in Redis key names and shown by the admin and "
            "explain",
            field=attr,
            hint=f"Key by the value's digest instead: write {hashed} in the template "
            f"(e.g. {attr} = 'payment:{hashed}'), or key by another field",
        )


def _refuse_unknown_options(
    name: str, namespace: Mapping[str, Any], refuse: declarations.Refuse
) -> None:
    decorator_keys = celery_decorator_keys()
    known = declared_names() | _CELERY_TASK_ATTRS | decorator_keys
    decorated = bool(namespace.get("_decorated"))
    for option in namespace:
        if option in known or option.startswith("__"):
            continue
        close = difflib.get_close_matches(option, sorted(known - decorator_keys), n=1, cutoff=0.75)
        # A decorator's keyword arguments are all options, so any unknown one is a typo.
        # A class body may hold the task's own helpers: refuse only near-misses there.
        if decorated or close:
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise refuse(f"unknown option {option!r}{hint}", option)


def _is_celery_class(klass: type) -> bool:
    return klass.__module__.startswith("celery.") or klass is object


def _example(field: str, task_name: str, sig: inspect.Signature) -> str:
    """A declaration of ``field`` built from this task's own name and run() parameters."""
    if field == "idempotency_key":
        params = [p for p in sig.parameters if p not in ("args", "kwargs")][:2]
        entity = task_name.rsplit(".", 1)[-1]
        parts = "".join(f":{{{p}}}" for p in params) or ":{some_id}"
        return f"idempotency_key = '{entity}{parts}' (the effect's business identity)"
    return {
        "visibility_timeout": "visibility_timeout = 60 (seconds; at least twice the run)",
        "expected_duration": "expected_duration = 5 (seconds a normal run takes)",
        "retry_on": "retry_on = (TimeoutError,) (errors worth retrying; () for none)",
        "fail_on": "fail_on = (ValueError,) (errors no retry can fix; () for none)",
    }[field]


def _exception_classes(
    value: object, field: str, refuse: declarations.Refuse
) -> tuple[type[BaseException], ...]:
    if isinstance(value, type):
        value = (value,)
    if not isinstance(value, tuple | list):
        raise refuse(
            f"{field}={value!r} must be a tuple of exception classes (an empty tuple says 'none')",
            field,
        )
    for item in value:
        if not (isinstance(item, type) and issubclass(item, BaseException)):
            raise refuse(f"{field} holds {item!r}, which is not an exception class", field)
    return tuple(value)
