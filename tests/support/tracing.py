"""OpenTelemetry for the worker and relay processes of the trace tests.

``tests/settings.py`` calls ``install_from_env()``: with ``EXPLICIT_TEST_TRACE_FILE``
set (tests/integration/test_tracing.py sets it for the processes it starts), the
process gets a global SDK tracer provider writing each finished span to that file, one
JSON object a line. Without it nothing is installed and tracing stays off, as in the
rest of the suite.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ENV = "EXPLICIT_TEST_TRACE_FILE"


def install_from_env() -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    # Line-buffered, appended: the prefork children inherit it and each span is one
    # write of one line. SimpleSpanProcessor exports in the calling thread (no thread to
    # lose across the fork).
    out = open(path, "a", buffering=1)  # noqa: SIM115 (lives as long as the process)
    provider = TracerProvider(resource=Resource.create({"service.name": f"pid-{os.getpid()}"}))
    provider.add_span_processor(
        SimpleSpanProcessor(
            ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")
        )
    )
    trace.set_tracer_provider(provider)


def read_spans(path: Path) -> list[dict[str, Any]]:
    """The spans the processes wrote to ``path`` so far."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
