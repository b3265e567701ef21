"""What becomes of one claimed outbox event: published, deduplicated, dead-lettered, or
backed off. The relay's publish policy; ``django_outbox.outbox.relay.loop`` runs the batches.

One event failing by itself never stops the relay: bad input and unknown tasks go to
the dead letters at once; other errors are recorded on the row (``attempts``,
``last_error``) and retried after a backoff of its own, until
``EXPLICIT_OUTBOX_MAX_ATTEMPTS``, then dead-lettered (``exhausted``) so the event stops
holding back its ordering key. A broker outage is not the event's fault: it is raised
to the relay, which backs the whole batch off.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from celery import Celery, Task
from celery.exceptions import QueueNotFound
from celery.utils.collections import lpmerge
from celery.utils.nodenames import anon_nodename
from celery.utils.saferepr import saferepr
from django.db.models import F
from django.db.models.functions import Now
from kombu.common import Broadcast

from celery_explicit import correlation, job_log, keys, sensitive, tracing
from celery_explicit.errors import BadInput, qualname
from celery_explicit.headers import (
    CORRELATION_HEADER,
    KEY_HEADER,
    PUBLISHED_VIA_HEADER,
    SENT_AT_HEADER,
)
from celery_explicit.metrics import dead_letters as dead_letters_total
from celery_explicit.retry_policy import backoff_delay
from django_outbox.models import DeadLetterReason, OutboxEvent, OutboxStatus
from django_outbox.outbox.relay.broker import BrokerConnection
from django_outbox.outbox.relay.claim import Claimed
from django_outbox.outbox.relay.metrics import dead_lettered, publish_failed
from django_outbox.store import dead_letters

__all__ = ["CeleryMessages", "PublishPolicy", "dead_letter_event", "log_fields"]

logger = job_log.get_logger("django_outbox.outbox.relay.loop")


@dataclass(frozen=True)
class PublishPolicy:
    """Publishes one event through its task and records what became of it, in the
    batch's transaction on ``using``."""

    app: Celery
    using: str
    broker: BrokerConnection
    max_attempts: int
    backoff_base: float
    backoff_cap: float
    rng: random.Random

    def messages(self, producer: Any) -> CeleryMessages:
        """The sender of one batch's messages through ``producer``."""
        return CeleryMessages(self.app, producer)

    def publish(self, event: Claimed, messages: CeleryMessages) -> OutboxStatus | None:
        """Publish one event; returns its new status, None if it stays pending."""
        if event.malformed:
            self.dead_letter(
                event,
                DeadLetterReason.BAD_INPUT,
                error_class="django_outbox.outbox.relay.loop.MalformedEvent",
                message=f"outbox event columns have the wrong shape: {event.malformed}",
            )
            return OutboxStatus.DEAD_LETTER
        task: Task[Any, Any] | None = messages.task(event.task_name)
        if task is None:
            self.dead_letter(
                event,
                DeadLetterReason.UNKNOWN_TASK,
                error_class="celery.exceptions.NotRegistered",
                message=f"outbox event names task {event.task_name!r}, which is not "
                "registered in the relay: not published",
            )
            return OutboxStatus.DEAD_LETTER
        event_id = event.event_id
        plan = messages.plan(task)
        try:
            # A span continuing the row's stored trace; its context replaces the stored one.
            with (
                tracing.relay_publish(event.task_name, str(event_id), event.headers)
                if messages.traced
                else nullcontext(event.headers)
            ) as headers:
                if plan is not None:
                    messages.send(
                        plan,
                        event_id,
                        tuple(event.args),
                        event.kwargs,
                        {PUBLISHED_VIA_HEADER: "outbox", **headers},
                        event.options,
                    )
                    return OutboxStatus.PUBLISHED
                sent = task.apply_async(
                    tuple(event.args),
                    event.kwargs,
                    task_id=event_id,
                    producer=messages.producer,
                    headers={PUBLISHED_VIA_HEADER: "outbox", **headers},
                    # Fail fast: the relay's own backoff replaces Celery's publish retries,
                    # which would hold the whole batch (and its row locks) meanwhile.
                    retry=False,
                    **event.options,
                )
        except BadInput as exc:
            self.dead_letter(
                event, DeadLetterReason.BAD_INPUT, error_class=qualname(exc), message=str(exc)
            )
            return OutboxStatus.DEAD_LETTER
        except QueueNotFound as exc:
            # A KeyError, which kombu's Redis transport counts among its connection
            # errors: caught first, or one event naming a removed queue would look like
            # a broker outage and hold the whole outbox back forever.
            return self.fail(event, exc)
        except self.broker.errors():
            raise
        except Exception as exc:
            # Anything else this one event raises is its own problem: it must not stop
            # the events after it.
            return self.fail(event, exc)
        # An ExplicitTask with a dedup_key publishes nothing when another message
        # owns the id, and hands back that message's id instead.
        if sent is not None and getattr(sent, "id", event_id) != event_id:
            return OutboxStatus.DEDUPLICATED
        return OutboxStatus.PUBLISHED

    def fail(self, event: Claimed, exc: Exception) -> OutboxStatus | None:
        """Back the event off, or dead-letter it past its attempts."""
        attempts = event.attempts + 1
        error_class = qualname(exc)
        message = f"{error_class}: {exc}"
        publish_failed.labels(event.task_name, error_class).inc()
        if attempts >= self.max_attempts:
            self.dead_letter(
                event,
                DeadLetterReason.EXHAUSTED,
                error_class=error_class,
                message=f"outbox event failed to publish {attempts} times: {message}",
            )
            return OutboxStatus.DEAD_LETTER
        delay = backoff_delay(attempts, base=self.backoff_base, cap=self.backoff_cap, rng=self.rng)
        OutboxEvent.objects.using(self.using).filter(id=event.id).update(
            attempts=F("attempts") + 1,
            last_error=message[:4000],
            available_at=Now() + timedelta(seconds=delay),
        )
        logger.warning(
            "outbox event %s (%s) failed to publish, attempt %d; next try in %.1fs: %s",
            event.event_id,
            event.task_name,
            attempts,
            delay,
            message,
            extra=log_fields(event, error_class=error_class, attempt=attempts),
        )
        return None

    def dead_letter(
        self, event: Claimed, reason: DeadLetterReason, *, error_class: str, message: str
    ) -> None:
        """Record the dead letter and close the event, in the batch's transaction."""
        dead_letter_event(
            event,
            reason,
            using=self.using,
            error_class=error_class,
            message=message,
            attempts=event.attempts + 1,
            columns={"attempts": F("attempts") + 1},
        )
        dead_lettered.labels(event.task_name, reason.value).inc()
        logger.error(
            "outbox event %s dead-lettered (%s): %s",
            event.event_id,
            reason.value,
            message,
            extra=log_fields(event, error_class=error_class, reason=reason.value),
        )


def dead_letter_event(
    event: Claimed | OutboxEvent,
    reason: DeadLetterReason,
    *,
    using: str,
    error_class: str,
    message: str,
    attempts: int,
    columns: Mapping[str, Any] | None = None,
) -> None:
    """Record the dead letter of an outbox event and close its row (status
    ``dead_letter``, ``last_error``, and ``columns``), in the caller's transaction on
    ``using``; counted in ``explicit_dead_letters_total``. The relay and the reconciler
    each count and log their own reason."""
    headers = _headers(event)
    dead_letters.record(
        task_id=str(event.event_id),
        task_name=event.task_name,
        reason=reason,
        args=event.args,
        kwargs=event.kwargs,
        idempotency_key=str(headers.get(KEY_HEADER) or ""),
        error_class=error_class,
        error_message=message,
        attempts=attempts,
        correlation_id=str(headers.get(CORRELATION_HEADER) or ""),
        queue=str((event.options or {}).get("queue") or ""),
    )
    OutboxEvent.objects.using(using).filter(id=event.id).update(
        status=OutboxStatus.DEAD_LETTER, last_error=message[:4000], **(columns or {})
    )
    dead_letters_total.labels(event.task_name, reason.value).inc()


def log_fields(event: Claimed | OutboxEvent, **more: Any) -> dict[str, Any]:
    """The fields of a log line about an outbox event; ``more`` added last."""
    return {
        "task": event.task_name,
        "job_id": str(event.event_id),
        "idempotency_key": str(_headers(event).get(KEY_HEADER) or ""),
        "ordering_key": event.ordering_key,
        "layer": "delivery",
        **more,
    }


def _headers(event: Claimed | OutboxEvent) -> dict[str, Any]:
    # A claimed row's are a dict (a malformed column is replaced by an empty one); a
    # model row's are what the column holds.
    return event.headers if isinstance(event.headers, dict) else {}


# --- the Celery message, built once per event -----------------------------------------
#
# ``task.apply_async`` costs about 250 µs an event, most of it not in building the
# message: six look-ups of Celery settings through Django's (an exception per miss),
# two ``saferepr`` walks, a copy and bind of the queue for kombu's declare cache, and
# Celery's routing of options it then merges again. A batch resolves what does not
# change within it once (``CeleryMessages``), and each event then runs what
# ``ExplicitTask.apply_async``, ``Task.apply_async`` and ``Celery.send_task`` would have
# run for it (arguments bound, key rendered, headers, exec options, the router), builds
# its message with Celery's own ``app.amqp.create_task_message`` and sends it with
# Celery's own ``app.amqp.send_task_message`` (the before/after_task_publish signals,
# serializer, delivery mode, exchange). What that path does not cover sends through
# ``task.apply_async`` as before (``_Plan.of`` says which): the wire is the same either
# way, which ``tests/integration/test_relay_speed_message.py`` checks message by message.
# Celery 5.7's code followed here: celery/app/task.py ``Task.apply_async``,
# celery/app/base.py ``Celery.send_task``, celery/app/amqp.py ``as_task_v2``.


@dataclass(frozen=True)
class _Plan:
    """What a batch sends every event of one task with (resolved once per batch)."""

    task: Any  # a Celery Task; its private parts (exec options, pydantic) are read
    explicit: bool
    exec_options: dict[str, Any]
    backend: Any

    @classmethod
    def of(cls, task: Any) -> _Plan | None:
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


class CeleryMessages:
    """One batch's sender of Celery messages through one producer."""

    def __init__(self, app: Celery, producer: Any) -> None:
        self.app = app
        self.producer = producer
        conf = app.conf
        # Inside a worker's task the message would carry its parent's ids: rare enough
        # for the relay (a test calling drain() from a task) to leave to apply_async.
        self.enabled = not (
            conf.task_always_eager or conf.task_send_sent_event or app.current_worker_task
        )
        self.repr_levels = conf.task_repr_maxlevels
        self.default_queue = conf.task_default_queue
        self.reply_to = app.thread_oid
        self.origin = anon_nodename()
        self.amqp = app.amqp
        self.router: Any = app.amqp.router
        self.repr_maxsize = (app.amqp.argsrepr_maxsize, app.amqp.kwargsrepr_maxsize)
        self.tasks = app.tasks
        # Off: no span per event (checking costs as much as the rest of the headers).
        self.traced = tracing.enabled()
        self._plans: dict[str, _Plan | None] = {}
        self._declared: set[str] = set()

    def task(self, name: str) -> Task[Any, Any] | None:
        """The registered task of that name, None if the relay knows none."""
        task: Task[Any, Any] | None = self.tasks.get(name)
        return task

    def plan(self, task: Task[Any, Any]) -> _Plan | None:
        # Per batch, so a redeclared task or a changed setting is seen by the next batch;
        # at most one entry per task name in the batch.
        name = task.name
        if name not in self._plans:
            self._plans[name] = _Plan.of(task) if self.enabled else None
        return self._plans[name]

    def send(
        self,
        plan: _Plan,
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        headers: dict[str, Any],
        stored_options: dict[str, Any],
    ) -> None:
        """What ``ExplicitTask.apply_async`` (or Celery's) would send for this event."""
        task = plan.task
        options: dict[str, Any] = {}
        if plan.explicit:
            contract = task.contract
            _arguments, given = task.bind_arguments(args, kwargs)
            headers[KEY_HEADER] = keys.render_key(task.name, contract.idempotency_key, given)
            if CORRELATION_HEADER not in headers:  # the row has it (outbox.write)
                headers[CORRELATION_HEADER] = correlation.for_publish()
            if contract.sensitive:
                shown_args, shown_kwargs = sensitive.redact(
                    contract.sensitive, contract.signature, args, kwargs
                )
                options["argsrepr"] = repr(tuple(shown_args))
                options["kwargsrepr"] = repr(shown_kwargs)
            sent_at = time.time()
            headers[SENT_AT_HEADER] = sent_at
            options["timestamp"] = int(sent_at)
        elif task.typing:
            check = getattr(task, "__header__", None)
            if check is not None:
                check(*args, **kwargs)
        options = {**plan.exec_options, **options, **stored_options}
        options.setdefault("ignore_result", task.ignore_result)
        time_limit = options.pop("time_limit", None)
        soft_time_limit = options.pop("soft_time_limit", None)
        options.pop("expires", None)
        ignore_result = options.pop("ignore_result", None)
        options["headers"] = headers
        options["retry"] = False
        amqp = self.amqp
        options = self._route(options, task, args, kwargs)
        # A sensitive task's redacted reprs stay in the options, as in send_task (which
        # hands them to kombu as message properties too).
        reprs = {
            "argsrepr": options.get("argsrepr") or self._repr(args, self.repr_maxsize[0]),
            "kwargsrepr": options.get("kwargsrepr") or self._repr(kwargs, self.repr_maxsize[1]),
        }
        message = amqp.create_task_message(
            task_id,
            task.name,
            args,
            kwargs,
            reply_to=self.reply_to,
            time_limit=time_limit,
            soft_time_limit=soft_time_limit,
            origin=self.origin,
            ignore_result=ignore_result,
            **{**options, **reprs},
        )
        options.pop("stamped_headers", None)
        options["declare"] = self._declare(options)
        producer = self.producer
        with producer.connection._reraise_as_library_errors():
            if not ignore_result:
                plan.backend.on_task_call(producer, task_id)
            amqp.send_task_message(producer, task.name, message, **options)

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
