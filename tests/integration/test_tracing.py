"""Traces through the outbox into a worker (``celery_explicit.tracing``), on real processes.

The test process records its spans (the "HTTP request", the outbox write) with the SDK's
in-memory exporter, through ``tracing.use_tracer_provider``: the global provider is
never set here, so the rest of the suite runs with tracing off. The relay and the
worker are separate processes: ``EXPLICIT_TEST_TRACE_FILE`` gives each a global SDK
provider writing its spans to a file (tests/support/tracing.py).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.db import transaction
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, format_span_id, format_trace_id

from celery_explicit import tracing
from django_outbox.models import Attempt, OutboxEvent, Outcome
from django_outbox.outbox.dispatch import dispatch
from tests.support import tracing as span_files
from tests.support.queues import queued
from tests.support.waiting import wait_for
from tests.testapp.models import Counter
from tests.testapp.tasks import Increment

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]

MALFORMED = "00-not-a-trace-id-01"


@pytest.fixture
def in_memory() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """This process's spans go to memory, for this test only."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_tracer_provider(provider)
    try:
        yield provider, exporter
    finally:
        tracing.use_tracer_provider(None)
        provider.shutdown()


@pytest.fixture
def span_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file the worker and relay processes started by this test write spans to."""
    path = tmp_path / "spans.jsonl"
    monkeypatch.setenv(span_files.ENV, str(path))
    return path


def _hex_trace(span: ReadableSpan) -> str:
    return "0x" + format_trace_id(span.context.trace_id)


def _hex_span(span: ReadableSpan) -> str:
    return "0x" + format_span_id(span.context.span_id)


def _named(spans: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    return [span for span in spans if span["name"].startswith(prefix)]


def test_one_trace_from_the_request_through_the_outbox_to_the_attempt(
    in_memory, span_file, start_worker, start_relay, queue
) -> None:
    provider, exporter = in_memory
    name = f"order{uuid.uuid4().hex[:6]}"
    Counter.objects.create(name=name)
    start_worker()
    start_relay()
    request_tracer = provider.get_tracer("tests.http")
    with (
        request_tracer.start_as_current_span("POST /orders", kind=SpanKind.SERVER),
        transaction.atomic(),
    ):
        Counter.objects.filter(name=name).update(value=0)  # the order, written
        event_id = dispatch(
            Increment(),
            kwargs={"name": name, "op_id": "7"},
            durable=True,
            options={"queue": queue},
        )
    wait_for(lambda: Attempt.objects.filter(outcome=Outcome.APPLIED).exists(), timeout=30)
    spans = wait_for(
        lambda: (
            (found := span_files.read_spans(span_file))
            and _named(found, "attempt ")
            and _named(found, "relay publish ")
            and found
        ),
        what="the relay's and the worker's spans",
        timeout=15,
    )
    local = {span.name: span for span in exporter.get_finished_spans()}
    request, write = local["POST /orders"], local["outbox write tests.increment"]
    [relayed] = _named(spans, "relay publish tests.increment")
    [attempt] = _named(spans, "attempt tests.increment")

    # One trace id across all four spans, each the child of the one before.
    trace_id = _hex_trace(request)
    assert {_hex_trace(write), relayed["context"]["trace_id"], attempt["context"]["trace_id"]} == {
        trace_id
    }
    assert write.parent is not None and write.parent.span_id == request.context.span_id
    assert relayed["parent_id"] == _hex_span(write)
    assert attempt["parent_id"] == relayed["context"]["span_id"]
    # Inside a relay publish the task's own publish span is not opened.
    assert not _named(spans, "publish ")

    assert write.kind is SpanKind.INTERNAL
    assert (relayed["kind"], attempt["kind"]) == ("SpanKind.PRODUCER", "SpanKind.CONSUMER")
    key = f"counter:{name}:op:7"
    assert dict(write.attributes or {})[tracing.IDEMPOTENCY_KEY] == key
    assert dict(write.attributes or {})[tracing.JOB_ID] == str(event_id)
    assert relayed["attributes"][tracing.JOB_ID] == str(event_id)
    assert attempt["attributes"] == {
        tracing.MESSAGING_SYSTEM: "celery",
        tracing.TASK: "tests.increment",
        tracing.JOB_ID: str(event_id),
        tracing.MESSAGE_ID: str(event_id),
        tracing.IDEMPOTENCY_KEY: key,
        tracing.ATTEMPT: 1,
        tracing.ENDING: "returned",
        tracing.OUTCOME: Outcome.APPLIED.value,
    }
    # Never the arguments: the order's name is in no span.
    assert name not in json.dumps([relayed, attempt]).replace(key, "")
    assert all(
        name not in str(value)
        for span in (request, write)
        for attr, value in (span.attributes or {}).items()
        if attr != tracing.IDEMPOTENCY_KEY
    )
    # The row kept the outbox write's context for the relay.
    row = OutboxEvent.objects.get(event_id=event_id)
    assert row.headers["traceparent"].split("-")[1:3] == [
        format_trace_id(write.context.trace_id),
        format_span_id(write.context.span_id),
    ]


def test_a_malformed_trace_header_is_ignored_with_one_warning(
    span_file, start_worker, queue
) -> None:
    assert not tracing.enabled()  # this process sends the header as given
    names = [f"bad{uuid.uuid4().hex[:6]}" for _ in range(3)]
    for name in names:
        Counter.objects.create(name=name)
    worker = start_worker(concurrency=1)  # one child: "once per process" is once
    for name in names:
        Increment().apply_async(
            kwargs={"name": name, "op_id": "1"}, queue=queue, headers={"traceparent": MALFORMED}
        )
    wait_for(lambda: Attempt.objects.filter(outcome=Outcome.APPLIED).count() == 3, timeout=30)
    attempts = wait_for(
        lambda: len(found := _named(span_files.read_spans(span_file), "attempt ")) == 3 and found,
        what="three attempt spans",
    )
    # Each attempt ran, in a new trace of its own.
    assert [span["parent_id"] for span in attempts] == [None, None, None]
    assert len({span["context"]["trace_id"] for span in attempts}) == 3
    assert {span["attributes"][tracing.OUTCOME] for span in attempts} == {"applied"}
    log = worker.log()
    assert log.count("ignoring a malformed trace context in message headers") == 1, log
    assert MALFORMED in log


def test_off_by_default_nothing_is_added_to_messages_or_rows(
    redis_client: redis.Redis, queue: str
) -> None:
    from opentelemetry import trace

    # The suite never sets a global provider: the API's proxy, so tracing is off.
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert not tracing.enabled()
    name = f"off{uuid.uuid4().hex[:6]}"
    try:
        Increment().apply_async(kwargs={"name": name, "op_id": "1"}, queue=queue)
        with transaction.atomic():
            event_id = dispatch(
                Increment(), kwargs={"name": name, "op_id": "2"}, durable=True, options={}
            )
        [message] = queued(redis_client, queue)
        assert "traceparent" not in message["headers"]
        assert "traceparent" not in json.loads(redis_client.lindex(queue, 0))["headers"]
        assert "traceparent" not in OutboxEvent.objects.get(event_id=event_id).headers
    finally:
        redis_client.delete(queue)


def test_on_the_same_hooks_add_the_context(
    in_memory, redis_client: redis.Redis, queue: str
) -> None:
    """The control for the test above: with a provider, the same publish carries it."""
    _provider, exporter = in_memory
    assert tracing.enabled()
    name = f"on{uuid.uuid4().hex[:6]}"
    try:
        sent = Increment().apply_async(kwargs={"name": name, "op_id": "1"}, queue=queue)
        [message] = queued(redis_client, queue)
        [published] = exporter.get_finished_spans()
        assert published.name == "publish tests.increment"
        assert published.kind is SpanKind.PRODUCER
        assert dict(published.attributes or {})[tracing.JOB_ID] == sent.id == message["id"]
        assert message["headers"]["traceparent"].split("-")[1:3] == [
            format_trace_id(published.context.trace_id),
            format_span_id(published.context.span_id),
        ]
    finally:
        redis_client.delete(queue)
