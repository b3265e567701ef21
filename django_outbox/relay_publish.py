"""What becomes of one claimed outbox event: published, deduplicated, dead-lettered, or
backed off. The relay's publish policy; ``django_outbox.relay`` runs the batches.

One event failing by itself never stops the relay: bad input and unknown tasks go to
the dead letters at once; other errors are recorded on the row (``attempts``,
``last_error``) and retried after a backoff of its own, until
``EXPLICIT_OUTBOX_MAX_ATTEMPTS``, then dead-lettered (``exhausted``) so the event stops
holding back its ordering key. A broker outage is not the event's fault: it is raised
to the relay, which backs the whole batch off.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from celery import Celery, Task
from celery.exceptions import QueueNotFound
from django.db.models import F
from django.db.models.functions import Now

from celery_explicit import idempotency, job_log, tracing
from celery_explicit.errors import BadInput, qualname
from celery_explicit.metrics import dead_letters as dead_letters_total
from celery_explicit.retry_policy import backoff_delay
from django_outbox import dead_letters
from django_outbox.claim import Claimed
from django_outbox.models import DeadLetterReason, OutboxEvent, OutboxStatus
from django_outbox.relay_broker import BrokerConnection
from django_outbox.relay_metrics import dead_lettered, publish_failed

__all__ = ["PublishPolicy"]

logger = job_log.get_logger("django_outbox.relay")


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

    def publish(self, event: Claimed, producer: Any) -> OutboxStatus | None:
        """Publish one event; returns its new status, None if it stays pending."""
        if event.malformed:
            self.dead_letter(
                event,
                DeadLetterReason.BAD_INPUT,
                error_class="django_outbox.relay.MalformedEvent",
                message=f"outbox event columns have the wrong shape: {event.malformed}",
            )
            return OutboxStatus.DEAD_LETTER
        task: Task[Any, Any] | None = self.app.tasks.get(event.task_name)
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
        try:
            # A span continuing the row's stored trace; its context replaces the stored one.
            with tracing.relay_publish(event.task_name, str(event_id), event.headers) as headers:
                sent = task.apply_async(
                    tuple(event.args),
                    event.kwargs,
                    task_id=event_id,
                    producer=producer,
                    headers={idempotency.PUBLISHED_VIA_HEADER: "outbox", **headers},
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
            extra=self._fields(event, error_class=error_class, attempt=attempts),
        )
        return None

    def dead_letter(
        self, event: Claimed, reason: DeadLetterReason, *, error_class: str, message: str
    ) -> None:
        """Record the dead letter and close the event, in the batch's transaction."""
        dead_letters.record(
            task_id=str(event.event_id),
            task_name=event.task_name,
            reason=reason,
            args=event.args,
            kwargs=event.kwargs,
            idempotency_key=str(event.headers.get(idempotency.KEY_HEADER) or ""),
            error_class=error_class,
            error_message=message,
            attempts=event.attempts + 1,
            correlation_id=str(event.headers.get(idempotency.CORRELATION_HEADER) or ""),
            queue=str(event.options.get("queue") or ""),
        )
        OutboxEvent.objects.using(self.using).filter(id=event.id).update(
            status=OutboxStatus.DEAD_LETTER,
            attempts=F("attempts") + 1,
            last_error=message[:4000],
        )
        dead_lettered.labels(event.task_name, reason.value).inc()
        dead_letters_total.labels(event.task_name, reason.value).inc()
        logger.error(
            "outbox event %s dead-lettered (%s): %s",
            event.event_id,
            reason.value,
            message,
            extra=self._fields(event, error_class=error_class, reason=reason.value),
        )

    @staticmethod
    def _fields(event: Claimed, **more: Any) -> dict[str, Any]:
        return {
            "task": event.task_name,
            "job_id": str(event.event_id),
            "idempotency_key": str(event.headers.get(idempotency.KEY_HEADER) or ""),
            "ordering_key": event.ordering_key,
            "layer": "delivery",
            **more,
        }
