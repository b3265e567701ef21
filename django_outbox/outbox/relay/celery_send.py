"""Celery's send path for a batch of relayed messages: the one place the relay reads
Celery's internals, for speed.

What ``Task.apply_async`` and ``Celery.send_task`` do for one message, with what does
not change within a batch resolved once (``Batch``): ``Batch.send_task`` is that path,
its message built by Celery's own ``app.amqp.create_task_message`` and sent by
Celery's own ``app.amqp.send_task_message``, which fires the ``before_task_publish``
and ``after_task_publish`` signals, as for any message ``apply_async`` sends.

Why not ``app.send_task(..., producer=producer)``, which takes the batch's producer
just as well: it costs about twice as much an event, most of it not in building the
message: six look-ups of Celery settings through Django's (an exception per miss), two
``saferepr`` walks, a copy and bind of the queue for kombu's declare cache, and
Celery's routing of options it then merges again. ``scripts/bench relay_send_path.py``
(one producer's pipeline, 2,000 events, paths interleaved): about 100 µs an event
here, 2.5 times that through ``app.send_task`` and 2.7 times through
``task.apply_async``, where the relay's whole cost is about 125 µs an event at batch
500 (bench/relay_throughput.py, P3b in docs/performance.md).

Used only on the Celery and kombu versions we test (``celery_explicit.versions``), and
only for the tasks ``Plan.of`` accepts; every other event goes through
``task.apply_async``. The wire is the same either way:
``tests/integration/test_relay_speed_message.py`` compares the two messages, and
``tests/integration/test_upstream_seams.py`` fails when Celery's send path takes a step
this one does not know. Celery 5.7.0's code followed here:

- https://github.com/celery/celery/blob/v5.7.0/celery/app/task.py#L587-L761
  (``Task.apply_async``: exec options, typing, shadow name, pydantic)
- https://github.com/celery/celery/blob/v5.7.0/celery/app/base.py#L1033-L1226
  (``Celery.send_task``: time limits, expiry, the router, the parent task, the
  backend's ``on_task_call``, ``_reraise_as_library_errors``)
- https://github.com/celery/celery/blob/v5.7.0/celery/app/routes.py#L66-L76
  (``Router.route``)
- https://github.com/celery/celery/blob/v5.7.0/celery/app/amqp.py#L531-L692
  (``send_task_message``: exchange, routing key, declare, the publish signals)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celery import Celery, Task
from celery.utils.collections import lpmerge
from celery.utils.nodenames import anon_nodename
from celery.utils.saferepr import saferepr
from kombu.common import Broadcast

from celery_explicit import versions
from celery_explicit.headers import stamp

__all__ = ["Batch", "Plan"]


@dataclass(frozen=True)
class Plan:
    """What a batch sends every event of one task with (resolved once per batch)."""

    task: Any  # a Celery Task; its private parts (exec options, pydantic) are read
    explicit: bool
    exec_options: dict[str, Any]
    backend: Any

    @classmethod
    def of(cls, task: Any) -> Plan | None:
        """None: this task publishes through ``task.apply_async``, one event at a time.

        That is every task whose publish does more than build and send one message: a
        dedup id or an ordering number to claim in Redis, an ``apply_async`` or
        ``shadow_name`` of its own, pydantic arguments, an expiry or time limits Celery
        would refuse."""
        from celery_explicit.task import ExplicitTask

        explicit = isinstance(task, ExplicitTask)
        own_apply = type(task).apply_async not in (ExplicitTask.apply_async, Task.apply_async)
        if (
            own_apply
            or type(task).shadow_name is not Task.shadow_name
            or task.__v2_compat__
            or task._dump_pydantic_arguments is not None
            or (explicit and (task.contract.dedup is not None or task.contract.ordering))
        ):
            return None
        exec_options = task._get_exec_options()
        if exec_options.get("expires") is not None or (
            task.soft_time_limit and task.time_limit and task.soft_time_limit > task.time_limit
        ):
            return None
        return cls(task, explicit, dict(exec_options), task.backend)


class Batch:
    """One batch's Celery send path through one producer."""

    def __init__(self, app: Celery, producer: Any = None) -> None:
        # None: messages are only built (``build``), as the outbox's writer does; what
        # it builds is what the relay sends, which names no parent task.
        self.producer = producer
        conf = app.conf
        # Inside a worker's task the message would carry its parent's ids: rare enough
        # for the relay (a test calling drain() from a task) to leave to apply_async.
        # On a Celery or kombu we have not tested, this path may no longer be Celery's.
        self.enabled = not (
            conf.task_always_eager
            or conf.task_send_sent_event
            or (producer is not None and app.current_worker_task)
            or versions.untested(versions.installed())
        )
        self.repr_levels = conf.task_repr_maxlevels
        self.default_queue = conf.task_default_queue
        self.reply_to = app.thread_oid
        self.origin = anon_nodename()
        self.amqp = app.amqp
        self.router: Any = app.amqp.router
        self.repr_maxsize = (app.amqp.argsrepr_maxsize, app.amqp.kwargsrepr_maxsize)
        self._plans: dict[str, Plan | None] = {}
        self._declared: set[str] = set()

    def plan(self, task: Task[Any, Any]) -> Plan | None:
        """How this batch sends ``task``'s events; None: through ``task.apply_async``."""
        # Per batch, so a redeclared task or a changed setting is seen by the next batch;
        # at most one entry per task name in the batch.
        name = task.name
        if name not in self._plans:
            self._plans[name] = Plan.of(task) if self.enabled else None
        return self._plans[name]

    def send_task(
        self,
        plan: Plan,
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        headers: dict[str, Any],
        options: dict[str, Any],
    ) -> None:
        """What ``task.apply_async(args, kwargs, task_id=task_id, producer=...,
        headers=headers, retry=False, **options)`` would send, sent the same way
        (``build``: our headers stamped on ``headers``)."""
        message, options, ignore_result = self.build(plan, task_id, args, kwargs, headers, options)
        options["declare"] = self._declare(options)
        producer = self.producer
        with producer.connection._reraise_as_library_errors():
            if not ignore_result:
                plan.backend.on_task_call(producer, task_id)
            self.amqp.send_task_message(producer, plan.task.name, message, **options)

    def build(
        self,
        plan: Plan,
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        headers: dict[str, Any],
        options: dict[str, Any],
        *,
        reply_to: str | None = None,
        key: str = "",
    ) -> tuple[Any, dict[str, Any], Any]:
        """Celery's message for one event, the options ``send_task_message`` takes with
        it (routed: the queue resolved), and whether its result is ignored. Nothing is
        sent; a prepared message (``django_outbox.outbox.prepared``) is built from these,
        with the writing thread's ``reply_to``.

        An ExplicitTask's message gets our headers and properties
        (``celery_explicit.headers.stamp``, on ``headers`` in place and on a copy of
        ``options``), as ``ExplicitTask.apply_async`` stamps them; ``key``: its
        idempotency key, rendered from these arguments by this process already (the
        outbox's writer), not rendered twice."""
        task = plan.task
        options = dict(options)
        if plan.explicit:
            stamp(task, args, kwargs, headers, options, key=key)
        if not plan.explicit and task.typing:
            check = getattr(task, "__header__", None)
            if check is not None:
                check(*args, **kwargs)
        options = {**plan.exec_options, **options}
        options.setdefault("ignore_result", task.ignore_result)
        time_limit = options.pop("time_limit", None)
        soft_time_limit = options.pop("soft_time_limit", None)
        options.pop("expires", None)
        ignore_result = options.pop("ignore_result", None)
        options["headers"] = headers
        # Fail fast: the relay's own backoff replaces Celery's publish retries, which
        # would hold the whole batch (and its row locks) meanwhile.
        options["retry"] = False
        options = self._route(options, task, args, kwargs)
        # A sensitive task's redacted reprs stay in the options, as in send_task (which
        # hands them to kombu as message properties too).
        reprs = {
            "argsrepr": options.get("argsrepr") or self._repr(args, self.repr_maxsize[0]),
            "kwargsrepr": options.get("kwargsrepr") or self._repr(kwargs, self.repr_maxsize[1]),
        }
        message = self.amqp.create_task_message(
            task_id,
            task.name,
            args,
            kwargs,
            reply_to=reply_to or self.reply_to,
            time_limit=time_limit,
            soft_time_limit=soft_time_limit,
            origin=self.origin,
            ignore_result=ignore_result,
            **{**options, **reprs},
        )
        options.pop("stamped_headers", None)
        return message, options, ignore_result

    def _route(
        self, options: dict[str, Any], task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """Celery's ``Router.route``; without ``task_routes``, with the default queue's
        name read once a batch instead of from Django's settings for every event."""
        router = self.router
        if router.routes:
            return router.route(options, task.name, args, kwargs, task)  # type: ignore[no-any-return]
        options = router.expand_destination(options)
        if "queue" not in options:
            # The stubs say lpmerge takes lists; it merges the two dicts.
            default = router.expand_destination(self.default_queue)
            options = lpmerge(default, options)  # type: ignore[arg-type,assignment]
        return options

    def _declare(self, options: dict[str, Any]) -> list[Any]:
        """Declare the event's queue once per batch, not once per message: kombu's
        declare cache copies and binds the queue on every look-up."""
        declare = options.get("declare")
        if declare is not None:
            return declare  # type: ignore[no-any-return]
        queue = options.get("queue")
        if queue is None and options.get("exchange") is None:
            queue = self.amqp.default_queue
        elif isinstance(queue, str):
            queue = self.amqp.queues[queue]
        if (
            queue is not None
            and not isinstance(queue, Broadcast)
            and queue.name not in self._declared
        ):
            self.producer.maybe_declare(queue)
            self._declared.add(queue.name)
        return []

    def _repr(self, value: tuple[Any, ...] | dict[str, Any], maxsize: int) -> str:
        """What Celery's ``saferepr`` returns, at a thirtieth of its cost where that is
        sure: ``repr()`` of a flat tuple or dict of scalars whose strings ``saferepr``
        would not quote differently. Anything else goes through ``saferepr`` itself."""
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        if all(_plain(item) for item in items):
            shown = repr(value)
            if len(shown) <= maxsize:
                return shown
        return saferepr(value, maxsize, maxlevels=self.repr_levels)


def _plain(value: Any) -> bool:
    # saferepr quotes every string in single quotes without escaping, and leaves
    # control characters as they are: repr() agrees only without quotes, backslashes
    # and unprintable characters.
    if isinstance(value, str):
        return value.isprintable() and "'" not in value and '"' not in value and "\\" not in value
    return value is None or isinstance(value, int | float)
