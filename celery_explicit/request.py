"""``ExplicitRequest``: the worker's main process, for what happens outside the handler.

A hard time limit that killed the handler is recorded (``on_timeout``), and a body of
the wrong shape is refused, not fatal:

Celery unpacks a task body as ``[args, kwargs, embed]`` while building the request in
the consumer; a body that decodes to anything else raises a ValueError there, which
Celery 5.7 treats as an unrecoverable error and stops the whole worker (and the
unacked message comes back to stop the next one). Raising InvalidTaskError instead
makes Celery reject the one message; ``django_outbox.store.unreached`` records it as a dead
letter with its raw body, and the worker goes on consuming.

A protocol 1 body is decoded in the main process and pickled to the pool (protocol 2
hands its headers there); one nested a few hundred levels deep raised RecursionError in
the pool's ``send_job`` (celery/concurrency/asynpool.py), which stopped the worker the
same way, and it depends on how deep the stack already is when the request is sent (a
request waiting for a pool slot is sent later, from elsewhere). A fixed bound decides
instead: ``bootsteps.RefuseMisshapen`` refuses any message whose headers or decoded
body nest deeper than ``MAX_NESTING`` (``nested_deeper_than``), before Celery builds a
request from it.
"""

from __future__ import annotations

from typing import Any

from celery.app.task import Context
from celery.exceptions import InvalidTaskError
from celery.worker.request import Request
from kombu.utils.objects import cached_property

from celery_explicit import ordering, sensitive, store


class ExplicitRequest(Request):
    @cached_property
    def _context(self) -> Context:
        """The task's context as the main process reports it: the result backend stores
        its arguments (``result_extended``) with a hard time limit's or a lost worker's
        FAILURE, and the failure signals see them. A sensitive field is redacted there."""
        context: Context = Request._context.func(self)  # type: ignore[attr-defined]
        shown = sensitive.for_task(self.task_name, self.task.app, self.args, self.kwargs)
        if shown.fields:
            context.args, context.kwargs = shown.arguments(self.args, self.kwargs)
        return context

    def on_timeout(self, soft: bool, timeout: float) -> None:
        """The hard time limit killed the handler: it never reached its own records."""
        if not soft:
            store.get().record_hard_timeout(
                task_id=self.id,
                task_name=self.task_name,
                message=self.message,
                timeout=timeout,
                args=self.args,
                kwargs=self.kwargs,
            )
            # The killed job ended for good (dead-lettered, acknowledged): the next job
            # of its entity may run now, not after the ordering gap. The handler's own
            # ``finally`` never ran, so the main process passes the turn.
            place = ordering.place_in(self.request_dict)
            ordering.pass_turn_on(place, task=self.task_name, job_id=self.id)
        super().on_timeout(soft, timeout)

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        try:
            super().__init__(message, *args, **kwargs)
        except (ValueError, TypeError) as exc:
            headers = getattr(message, "headers", None) or {}
            raise InvalidTaskError(
                f"body of task {headers.get('task')!r} is not [args, kwargs, embed]: {exc}"
            ) from exc
        # Celery's trace checks neither before calling the task (``fun(*args,
        # **kwargs)``): args that are None or kwargs that are a list failed there as the
        # task's own error, and the message was acked with no dead letter.
        if not isinstance(self.args, (list, tuple)) or not isinstance(self.kwargs, dict):
            raise InvalidTaskError(
                f"body of task {self.name!r} (id {self.id!r}): args must be a list and "
                f"kwargs a dict, not {type(self.args).__name__} and "
                f"{type(self.kwargs).__name__}"
            )
        # ``retries`` numbers the attempt (``int(request.retries or 0) + 1`` in the
        # pipeline): a dict there failed in the pool as the task's own error, acked with
        # no dead letter. Celery always writes a count.
        retries = self.request_dict.get("retries")
        if retries is not None and (not isinstance(retries, int) or retries < 0):
            raise InvalidTaskError(
                f"body of task {self.name!r} (id {self.id!r}): retries is not a count: "
                f"{type(retries).__name__}"
            )
        # ``timelimit`` is unpacked as (hard, soft) only when the request is sent to the
        # pool (``execute_using_pool``), possibly later from the pool's semaphore: an int
        # there stopped the worker ("Unrecoverable error").
        limits = self.request_dict.get("timelimit")
        if limits and not (
            isinstance(limits, (list, tuple))
            and len(limits) == 2
            and all(
                v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0)
                for v in limits
            )
        ):
            raise InvalidTaskError(
                f"body of task {self.name!r} (id {self.id!r}): timelimit is not "
                f"[hard, soft] seconds: {type(limits).__name__}"
            )
        wrong = _wrong_stamps(self.request_dict) or _wrong_embed(getattr(self, "_payload", None))
        if wrong:
            raise InvalidTaskError(f"body of task {self.name!r} (id {self.id!r}): {wrong}")


def _wrong_stamps(request: dict[str, Any]) -> str | None:
    """What is wrong with a message's ``stamped_headers`` and ``stamps``, if anything.

    Celery looks each stamped header name up in its revoked stamps (a dict) and reads
    its value from ``stamps.get(name)``, in the main process, when the request is sent
    to the pool (``Request.revoked``), possibly later from the pool's semaphore. A name
    that is a list raised TypeError there and stopped the whole worker, and the unacked
    message came back to stop the next one (tests/chaos/test_unexpected_bodies.py).
    """
    names = request.get("stamped_headers")
    if names and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        return f"stamped_headers is not a list of header names: {type(names).__name__}"
    stamps = request.get("stamps")
    if stamps and not isinstance(stamps, dict):
        return f"stamps is not a dict: {type(stamps).__name__}"
    return None


#: The parts of a body's ``embed`` Celery reads as lists of signatures, and as one.
_SIGNATURE_LISTS = ("callbacks", "errbacks", "chain")


def _wrong_embed(payload: Any) -> str | None:
    """What is wrong with the ``embed`` of a ``[args, kwargs, embed]`` body, if anything.

    Celery reads it in the main process only once the task has ended: ``Request.
    _context`` (``request.update(**embed or {})``) and the backend's errbacks and chord
    in ``on_failure``. A list there, or errbacks that are a number, raised TypeError in
    the pool's result callback ("Pool callback raised exception"): the message was
    neither acked nor rejected, nor dead-lettered, and came back to fail the same way.
    """
    embed = payload[2] if isinstance(payload, (list, tuple)) and len(payload) > 2 else None
    if not embed:
        return None  # Celery reads ``embed or {}``
    if not isinstance(embed, dict):
        return f"embed is {type(embed).__name__}, not a dict"
    for name in _SIGNATURE_LISTS:
        value = embed.get(name)
        if value and not (
            isinstance(value, list) and all(isinstance(item, dict) for item in value)
        ):
            return f"embed {name!r} is not a list of signatures: {type(value).__name__}"
    chord = embed.get("chord")
    if chord and not isinstance(chord, dict):
        return f"embed 'chord' is not a signature: {type(chord).__name__}"
    return None


#: How deep lists and dicts may nest in a message (headers, decoded body): far below
#: ``sys.getrecursionlimit()`` (1,000), so that pickling a message for the pool, encoding
#: it as JSON for a dead letter or printing it never runs out of stack, from however deep
#: a stack it happens. No task of ours takes arguments nested anywhere near this.
MAX_NESTING = 200

_CONTAINERS = (list, tuple, dict, set, frozenset)


def nested_deeper_than(value: Any, bound: int = MAX_NESTING) -> bool:
    """True when lists, tuples, dicts or sets nest in ``value`` more than ``bound``
    levels deep (``value`` itself is level 1 when it is one).

    Without recursion (an explicit stack): a value nested past the recursion limit is
    measured without raising. Only containers are pushed, and the walk stops at the
    first level past ``bound``; a usual message (some 30 headers, a short body) takes a
    few microseconds. Dict keys are not walked: JSON keys are strings.
    """
    if not isinstance(value, _CONTAINERS):
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, _CONTAINERS):
                if depth >= bound:
                    return True
                stack.append((child, depth + 1))
    return False
