"""What the tests read from the broker: the messages waiting in a Redis-broker queue."""

from __future__ import annotations

import base64
import json
from typing import Any


def queued(client: Any, queue: str) -> list[dict[str, Any]]:
    """Messages waiting in a Redis-broker queue, oldest first, as
    ``{"id", "task", "headers", "args", "kwargs"}``."""
    messages = []
    # kombu LPUSHes and workers BRPOP: the oldest message is at the right end.
    for raw in reversed(client.lrange(queue, 0, -1)):
        envelope = json.loads(raw)
        args, kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
        headers = envelope["headers"]
        messages.append(
            {
                "id": headers["id"],
                "task": headers["task"],
                "headers": headers,
                "args": args,
                "kwargs": kwargs,
            }
        )
    return messages
