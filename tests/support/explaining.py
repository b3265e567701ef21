"""What ``manage.py explicit_explain`` prints for a job, as text, as data, and its verdict line."""

from __future__ import annotations

import io
import json
from typing import Any

from django.core.management import call_command


def explain(what: str) -> str:
    out = io.StringIO()
    call_command("explicit_explain", what, stdout=out)
    return out.getvalue()


def explain_json(what: str) -> dict[str, Any]:
    out = io.StringIO()
    call_command("explicit_explain", what, "--json", stdout=out)
    data: dict[str, Any] = json.loads(out.getvalue())
    return data


def verdict_of(text: str) -> str:
    return next(line for line in text.splitlines() if "verdict:" in line)
