"""The headers our messages carry, and the one place that builds them at publish.

Every message of an ExplicitTask carries its idempotency key, its correlation id, how
it was first published and when it was sent, so a consumer, a log line or an operator
reads them from the message itself; a re-publish (a retry, a deferral) carries its
deferral counts too. This module names each header once; the worker reads them back
from the request (Celery copies each header onto it as an attribute).

``stamp`` builds them, for both senders of our messages: ``ExplicitTask.apply_async``
and the outbox relay, which sends most of its messages through Celery's send path
without ``apply_async`` (``django_outbox.outbox.relay.celery_send``). A header added
here is on both; ``tests/unit/test_message_headers.py`` compares what the two send.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from celery_explicit import correlation, keys, sensitive

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
#: Message header on a copy of a job published while an earlier execution of it may
#: still run (the outbox reconciler's republish): finding the execution lease free, it
#: writes its fence first, as a redelivery does (``execution_lease_step``).
FENCE_FREE_LEASE_HEADER = "explicit_fence_free_lease"
#: Message header with the time it was put on the broker (Unix seconds): set on every
#: publish, re-publishes included, so the age of a queue's oldest message and a job's
#: wait in the queue can be read from the message itself.
SENT_AT_HEADER = "explicit_sent_at"

#: Message header on a job a beat published for a periodic entry: its schedule slot,
#: the time the entry was due (``20250601T100000Z``, ``celery_explicit.periodic``).
SLOT_HEADER = "explicit_slot"
#: Message header naming the periodic entry (its name in the beat schedule).
PERIODIC_ENTRY_HEADER = "explicit_periodic_entry"


def correlation_of(request: Any) -> str:
    """The request that caused this job: the header, else Celery's root task id."""
    return str(getattr(request, CORRELATION_HEADER, None) or request.root_id or request.id or "")


def stamp(
    task: Any,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    headers: dict[str, Any],
    options: dict[str, Any],
    *,
    republish: bool = False,
    key: str = "",
) -> dict[str, Any] | None:
    """Add our headers to ``headers`` and our message properties to ``options`` (the
    caller's publish options, both changed in place) for one publish of ``task``, an
    ExplicitTask, with these arguments. A value the caller gave is kept, but for the key.

    A first publish binds the arguments (``BadInput`` if they do not fit ``run()``),
    renders the idempotency key from them, names how it was published (``"direct"``
    unless the caller says ``"on_commit"`` or ``"outbox"``) and is given a correlation
    id (its caller's context's, else a new one); it returns the arguments the caller
    gave, for the other keys its mechanisms render (ordering, dedup). A re-publish
    (``republish``: a retry, a deferral) already carries the job's own headers
    (``republish.carry_headers``): None. ``key``: the idempotency key this process
    rendered from these very arguments a moment before (the outbox's writer, which
    checked the call with ``outbox.events.check_call``), taken as it is: they are
    neither bound nor rendered again, and None is returned.

    Every publish gets the time it is sent, in a header and as the message's AMQP
    ``timestamp`` (whole seconds: RabbitMQ's management API reports it for a queue's
    head message, the only way to read its age there), and a task with sensitive
    fields shows them redacted in what Celery logs and sends in events instead of the
    arguments (``argsrepr``, ``kwargsrepr``).
    """
    contract = task.contract
    args = tuple(args or ())
    # Bound as they are (binding reads them): the relay stamps a batch, event by event.
    kwargs = kwargs if isinstance(kwargs, dict) else dict(kwargs or {})
    given: dict[str, Any] | None = None
    if not republish:
        headers.setdefault(PUBLISHED_VIA_HEADER, "direct")
        if key:
            headers[KEY_HEADER] = key
        else:
            _arguments, given = task.bind_arguments(args, kwargs)
            headers[KEY_HEADER] = keys.render_key(task.name, contract.idempotency_key, given)
        if CORRELATION_HEADER not in headers:  # an outbox row has it (outbox.write)
            headers[CORRELATION_HEADER] = correlation.for_publish()
    if contract.sensitive:
        shown_args, shown_kwargs = sensitive.redact(
            contract.sensitive, contract.signature, args, kwargs
        )
        options.setdefault("argsrepr", repr(tuple(shown_args)))
        options.setdefault("kwargsrepr", repr(shown_kwargs))
    sent_at = time.time()
    headers[SENT_AT_HEADER] = sent_at
    options.setdefault("timestamp", int(sent_at))
    return given
