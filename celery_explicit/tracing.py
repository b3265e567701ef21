"""Traces: one OpenTelemetry trace from the request that wrote a job to the worker's attempt.

Optional (``pip install celery-explicit[otel]``), and on only when the process has a
real tracer provider: the OpenTelemetry API importable *and* a provider set
(``trace.set_tracer_provider(TracerProvider(...))``, or ``use_tracer_provider``), not
the API's default proxy or no-op one. Off, each hook below is one cached check and
adds nothing to any message.

Four spans, each opened by one hook, with the trace context carried in the message
headers (and in the outbox row's stored headers, so the relay, another process, can
continue it later):

====================  =========  ==============================================
span                  kind       opened by
====================  =========  ==============================================
``publish <task>``    PRODUCER   ``ExplicitTask.apply_async`` around the send
``outbox write <t>``  INTERNAL   ``django_outbox.outbox.events.write`` around the insert
``relay publish <t>`` PRODUCER   the relay, child of the row's stored context
``attempt <task>``    CONSUMER   ``pipeline.deliver``, child of the message's
====================  =========  ==============================================

Inside a relay publish the task's own ``publish`` span is not opened: one producer
span per message sent, and the trace reads request, outbox write, relay publish,
attempt. Their attributes name the task, the job id (the task id), the idempotency
key, the attempt and how it ended; never the arguments (they may be personal data).

Propagation is OpenTelemetry's own: ``opentelemetry.propagate`` with the globally
configured propagator (W3C ``traceparent`` / ``tracestate`` and ``baggage`` by
default). A trace header that does not parse is ignored: the span starts a new trace,
and the first one of each kind (message headers, outbox row) is logged once per
process, at WARNING; a flood of bad headers is not a flood of log lines.

``opentelemetry-instrumentation-celery`` (``CeleryInstrumentor``) traces Celery's
signals instead (``apply_async/<task>``, ``run/<task>``) and knows nothing of the
outbox, the idempotency key or the attempt's outcome. Both may run: its
``before_task_publish`` hook injects last, so the message then carries its span, a
child of ours; on the worker, its ``run/`` span is current when the attempt starts,
and the attempt becomes its child instead of extracting the headers a second time.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

from celery.exceptions import Ignore, Reject, Retry

from celery_explicit.execution import running
from celery_explicit.headers import KEY_HEADER

try:
    from opentelemetry import propagate, trace
    from opentelemetry.context import Context
except ImportError:  # the otel extra is not installed: tracing stays off
    _API = False
else:
    _API = True

__all__ = [
    "attempt",
    "enabled",
    "outbox_write",
    "publish",
    "relay_publish",
    "use_tracer_provider",
]

logger = logging.getLogger("celery_explicit.tracing")

#: The instrumentation scope of every span we start.
SCOPE = "celery_explicit"

# Span attributes. OpenTelemetry's messaging conventions where one fits, ours otherwise;
# the job id is also under our name, as in our log lines.
MESSAGING_SYSTEM = "messaging.system"
MESSAGE_ID = "messaging.message.id"
TASK = "celery_explicit.task"
JOB_ID = "celery_explicit.job_id"
IDEMPOTENCY_KEY = "celery_explicit.keys_key"
ATTEMPT = "celery_explicit.attempt"
#: How the attempt ended, as its attempt row says (``applied``, ``already_applied``...),
#: where the execution knows it.
OUTCOME = "celery_explicit.outcome"
#: How the delivery left the job path: returned, retry, ignored (a deferral or a drop
#: by the handler), rejected, raised.
ENDING = "celery_explicit.ending"

# A header only the baggage propagator writes does not carry a span context: its
# presence without a traceparent is not malformed.
_BAGGAGE_FIELDS = frozenset({"baggage"})

_OFF: AbstractContextManager[None] = nullcontext()
_provider_override: Any = None
_tracer_cache: Any = None
_warned: set[str] = set()
# Set while the relay publishes one event: the task's own publish span is not opened.
_relaying: ContextVar[bool] = ContextVar("celery_explicit_relaying", default=False)


def use_tracer_provider(provider: Any) -> None:
    """Start our spans on ``provider`` instead of OpenTelemetry's global one.

    For a process that keeps its global provider for something else, and for tests
    (the global provider can be set only once per process). ``None``: back to the
    global provider.
    """
    global _provider_override, _tracer_cache
    _provider_override = provider
    _tracer_cache = None


def enabled() -> bool:
    """Whether this process records our spans (see the module docstring)."""
    return _tracer() is not None


def _tracer() -> Any:
    """Our tracer, or None when tracing is off: the one check every hook makes."""
    global _tracer_cache
    if _tracer_cache is not None:
        return _tracer_cache
    if not _API:
        return None
    provider = _provider_override or trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        # Not set yet; it may be later (a worker child's worker_process_init).
        return None
    # The global provider is set once per process: a real one, once seen, stays.
    _tracer_cache = provider.get_tracer(SCOPE)
    return _tracer_cache


# --- the four spans ------------------------------------------------------------------


def publish(
    task_name: str, task_id: str | None, headers: MutableMapping[str, Any]
) -> AbstractContextManager[str | None]:
    """Around one send of ``task_name``: a PRODUCER span whose context is injected into
    ``headers``. Yields the task id to send with: chosen here (a uuid4, as Celery would)
    when the caller gave none, so the span can name the job."""
    tracer = _tracer()
    if tracer is None or _relaying.get():
        return nullcontext(task_id)
    return _publish(tracer, task_name, task_id or str(uuid.uuid4()), headers)


@contextmanager
def _publish(
    tracer: Any, task_name: str, task_id: str, headers: MutableMapping[str, Any]
) -> Iterator[str]:
    attributes = _job_attributes(task_name, task_id, headers.get(KEY_HEADER))
    with _span(tracer, f"publish {task_name}", trace.SpanKind.PRODUCER, attributes):
        _inject(headers)
        yield task_id


def outbox_write(
    task_name: str, event_id: str, idempotency_key: str, headers: MutableMapping[str, Any]
) -> AbstractContextManager[None]:
    """Around the insert of one outbox row: an INTERNAL span whose context is injected
    into the row's ``headers`` before they are stored, for the relay to continue."""
    tracer = _tracer()
    if tracer is None:
        return _OFF
    return _outbox_write(tracer, task_name, event_id, idempotency_key, headers)


@contextmanager
def _outbox_write(
    tracer: Any,
    task_name: str,
    event_id: str,
    idempotency_key: str,
    headers: MutableMapping[str, Any],
) -> Iterator[None]:
    attributes = _job_attributes(task_name, event_id, idempotency_key)
    with _span(tracer, f"outbox write {task_name}", trace.SpanKind.INTERNAL, attributes):
        _inject(headers)
        yield


def relay_publish(
    task_name: str, event_id: str, stored_headers: Mapping[str, Any]
) -> AbstractContextManager[Mapping[str, Any]]:
    """Around the relay's publish of one outbox row: a PRODUCER span, child of the
    context stored in the row. Yields the headers to send: the stored ones with this
    span's context in place of the stored one."""
    tracer = _tracer()
    if tracer is None:
        return nullcontext(stored_headers)
    return _relay_publish(tracer, task_name, event_id, stored_headers)


@contextmanager
def _relay_publish(
    tracer: Any, task_name: str, event_id: str, stored_headers: Mapping[str, Any]
) -> Iterator[Mapping[str, Any]]:
    parent = _extract(stored_headers, "outbox row headers")
    attributes = _job_attributes(task_name, event_id, stored_headers.get(KEY_HEADER))
    headers = dict(stored_headers)
    name = f"relay publish {task_name}"
    with _span(tracer, name, trace.SpanKind.PRODUCER, attributes, context=parent):
        _inject(headers)
        token = _relaying.set(True)
        try:
            yield headers
        finally:
            _relaying.reset(token)


def attempt(task: Any, request: Any) -> AbstractContextManager[None]:
    """Around one delivery of ``request`` to ``task``'s job path: a CONSUMER span, child
    of the context its message carries (or of a span already current: another
    instrumentation's), ending with the attempt's outcome."""
    tracer = _tracer()
    if tracer is None:
        return _OFF
    return _attempt(tracer, task, request)


@contextmanager
def _attempt(tracer: Any, task: Any, request: Any) -> Iterator[None]:
    parent: Context | None = None  # a span already current (e.g. CeleryInstrumentor's run/)
    if not trace.get_current_span().get_span_context().is_valid:
        parent = _extract(_trace_headers_of(request), "message headers")
    attributes = _job_attributes(
        task.name, str(request.id or ""), getattr(request, KEY_HEADER, None)
    )
    attributes[ATTEMPT] = int(request.retries or 0) + 1
    with _span(tracer, f"attempt {task.name}", trace.SpanKind.CONSUMER, attributes, parent) as span:
        ending = "returned"
        try:
            yield
        except Retry:
            ending = "retry"
            raise
        except Ignore:
            ending = "ignored"
            raise
        except Reject:
            ending = "rejected"
            raise
        except BaseException:
            ending = "raised"  # recorded on the span by _span
            raise
        finally:
            span.set_attribute(ENDING, ending)
            execution = running(request)
            if execution is not None:
                # The key of record (rendered again by the worker) and how it ended.
                if execution.key:
                    span.set_attribute(IDEMPOTENCY_KEY, execution.key)
                if execution.outcome is not None:
                    span.set_attribute(OUTCOME, execution.outcome.value)


# --- helpers -------------------------------------------------------------------------


@contextmanager
def _span(
    tracer: Any,
    name: str,
    kind: Any,
    attributes: dict[str, Any],
    context: Context | None = None,
) -> Iterator[Any]:
    with tracer.start_as_current_span(
        name,
        context=context,
        kind=kind,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except (Retry, Ignore, Reject):
            # How a job goes on (a retry, a deferral), not an error of this span.
            raise
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__qualname__))
            raise


def _job_attributes(task_name: str, job_id: str, key: Any) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        MESSAGING_SYSTEM: "celery",
        TASK: task_name,
        JOB_ID: job_id,
        MESSAGE_ID: job_id,
    }
    if key:
        attributes[IDEMPOTENCY_KEY] = str(key)
    return attributes


def _inject(headers: MutableMapping[str, Any]) -> None:
    """The current context into ``headers``, replacing any it carried before."""
    for field in propagate.get_global_textmap().fields:
        headers.pop(field, None)
    propagate.inject(headers)


def _trace_headers_of(request: Any) -> dict[str, Any]:
    """The propagator's headers of a delivered message. Celery sets a message's custom
    headers as attributes of ``task.request`` (protocol 2), and keeps them in
    ``request.headers`` too on some paths."""
    custom = getattr(request, "headers", None) or {}
    found: dict[str, Any] = {}
    for field in propagate.get_global_textmap().fields:
        value = getattr(request, field, None)
        if value is None and isinstance(custom, Mapping):
            value = custom.get(field)
        if value is not None:
            found[field] = value
    return found


def _extract(headers: Mapping[str, Any], where: str) -> Context:
    """The context ``headers`` carry; a fresh one (a new trace) when they carry none, or
    one that does not parse (warned once per process per ``where``)."""
    textmap = propagate.get_global_textmap()
    present = {field: headers[field] for field in textmap.fields if field in headers}
    carrier = {field: value for field, value in present.items() if isinstance(value, str)}
    context: Context = textmap.extract(carrier)
    if set(present) - _BAGGAGE_FIELDS and not (
        trace.get_current_span(context).get_span_context().is_valid
    ):
        _warn_malformed(where, present)
    return context


def _warn_malformed(where: str, present: Mapping[str, Any]) -> None:
    if where in _warned:
        return
    _warned.add(where)
    shown = {field: str(value)[:80] for field, value in present.items()}
    logger.warning(
        "ignoring a malformed trace context in %s %s: the span starts a new trace "
        "(logged once per process; later ones are ignored silently)",
        where,
        shown,
        extra={"layer": "tracing"},
    )
