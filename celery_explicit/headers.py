"""The headers our messages carry, and the one place that builds them at publish.

Every message of an ExplicitTask carries its idempotency key, its correlation id, how
it was first published and when it was sent, so a consumer, a log line or an operator
reads them from the message itself; a re-publish (a retry, a deferral) carries its
deferral counts too. This module names each header once; the worker reads them back
from the request (Celery copies each header onto it as an attribute).
"""

from __future__ import annotations

from typing import Any

#: Message header carrying the rendered key from the moment of publishing.
KEY_HEADER = "idempotency_key"
#: Message header carrying the correlation id (the request that caused the job). Not
#: ``correlation_id``: Celery sets that message property to the task id, and the
#: request's attribute of that name is the property, so a header of that name was lost.
CORRELATION_HEADER = "explicit_correlation_id"
#: Message header linking a replayed message to its dead letter.
REPLAY_HEADER = "replay_of"
#: Message header naming how the job was first published: "direct" (apply_async),
#: "on_commit" (dispatch after the caller's commit) or "outbox" (the relay).
PUBLISHED_VIA_HEADER = "explicit_published_via"
#: Message header counting the job's deferrals so far, by the step that deferred it
#: ({"execution_lease": 2}): carried by each re-publish, stored on the attempt row.
DEFERRALS_HEADER = "explicit_deferrals"
#: Message header on a deferral's re-publish of a delivery the broker had redelivered:
#: the copy that finally runs is still that redelivery, and its attempt row says so.
REDELIVERED_HEADER = "explicit_redelivered"
#: Message header with the time it was put on the broker (Unix seconds): set on every
#: publish, re-publishes included, so the age of a queue's oldest message and a job's
#: wait in the queue can be read from the message itself.
SENT_AT_HEADER = "explicit_sent_at"


def correlation_of(request: Any) -> str:
    """The request that caused this job: the header, else Celery's root task id."""
    return str(getattr(request, CORRELATION_HEADER, None) or request.root_id or request.id or "")
