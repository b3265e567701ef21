"""The broker checks: the broker's own timeouts against each task's lease and retries.

The broker redelivers a message it thinks is lost, whatever the task's lease says: on
Redis after the transport's ``visibility_timeout`` (the global backstop), on RabbitMQ
when ``consumer_timeout`` closes the channel. A task that holds its message longer is
run twice. These checks compare the two; retention's ledger floor reads the same
transport defaults.

- E003 a task's lease is longer than Redis's visibility timeout
- W001 a task's retry delay can outlast Redis's visibility timeout: a retry waiting in
  a worker (an ETA message) would be redelivered to another one meanwhile
- W002 kombu's restore sweep runs less often than a task's lease: a dead worker's job
  waits for the sweep, not for its own lease
- W003 no broker URL: Celery falls back to a local AMQP broker these checks cannot see
- W011 RabbitMQ: a task's lease or retry delay is as long as ``consumer_timeout``
- W014 RabbitMQ without publisher confirms: a relayed event is marked published, and a
  retry's or deferral's message acked away, on the broker's silence
- E009 ``EXPLICIT_OUTBOX_PREPARED_MESSAGES`` on a broker other than Redis: the stored
  messages are kombu's Redis envelope, which no other transport reads
"""

from __future__ import annotations

from typing import Any

from django.core import checks

from django_outbox.conf import settings

__all__ = [
    "REDIS_DEFAULT_SWEEP",
    "REDIS_DEFAULT_VISIBILITY_TIMEOUT",
    "REDIS_URL_SCHEMES",
    "RABBITMQ_URL_SCHEMES",
    "check_broker_url",
    "check_confirms",
    "check_prepared_messages",
    "check_consumer_timeout",
    "check_visibility",
    "redis_sweep",
]

# kombu's Redis transport defaults (kombu/transport/redis.py): the backstop
# (Channel.visibility_timeout), and the restore sweep every 10 s scanning on every 10th
# (unacked_restore_interval, unacked_restore_throttle; celery_explicit.message_lease).
REDIS_DEFAULT_VISIBILITY_TIMEOUT = 3600.0
REDIS_DEFAULT_SWEEP = (10.0, 10.0)

REDIS_URL_SCHEMES = ("redis://", "rediss://", "redis+socket://", "sentinel://")
RABBITMQ_URL_SCHEMES = ("amqp://", "amqps://", "pyamqp://")


def redis_sweep(options: dict[str, Any]) -> float:
    """How often, at worst, kombu's Redis transport restores an expired message."""
    return float(options.get("unacked_restore_interval", REDIS_DEFAULT_SWEEP[0])) * float(
        options.get("unacked_restore_throttle", REDIS_DEFAULT_SWEEP[1])
    )


def check_broker_url(app: Any, tasks: list[Any]) -> list[checks.CheckMessage]:
    """Without a broker URL Celery quietly uses amqp://guest@localhost//: the Redis
    transport options (and the backstop check E003) then do nothing."""
    if not tasks or app.conf.broker_url:
        return []
    return [
        checks.Warning(
            f"Celery app {app.main!r} runs ExplicitTasks but has no broker URL: Celery "
            "falls back to amqp://guest@localhost//, and the broker checks here "
            "(visibility timeout E003, restore sweep W002) cannot see your broker",
            hint="Set CELERY_BROKER_URL (or broker_url on the app), e.g. "
            "'redis://127.0.0.1:6379/0'.",
            id="django_outbox.W003",
        )
    ]


def check_consumer_timeout(app: Any, tasks: list[Any]) -> list[checks.CheckMessage]:
    """W011: RabbitMQ closes the channel of a delivery unacknowledged for longer than
    its ``consumer_timeout`` (30 min by default), and every message on it is
    redelivered. With ``acks_late`` a job holds its message while it runs, and a retry
    or deferral waiting for its ETA holds it in the worker too."""
    url = str(app.conf.broker_url or "")
    if not url.startswith(RABBITMQ_URL_SCHEMES):
        return []
    limit = settings.rabbitmq_consumer_timeout
    if limit <= 0:
        return []
    found: list[checks.CheckMessage] = []
    for task in sorted(tasks, key=lambda t: t.name):
        contract = task.contract
        longest = max(
            contract.visibility_timeout, contract.retry.backoff_cap, contract.max_run_time or 0
        )
        if longest >= limit:
            found.append(
                checks.Warning(
                    f"task {task.name} may hold its message {longest:g}s (its lease, "
                    f"backoff_cap or max_run_time), as long as RabbitMQ's consumer_timeout "
                    f"of {limit:g}s: the broker would close the channel and redeliver "
                    "every message on it",
                    hint="Raise consumer_timeout in rabbitmq.conf (or the queue's "
                    "x-consumer-timeout) and EXPLICIT_RABBITMQ_CONSUMER_TIMEOUT with it, or "
                    "shorten the task's lease and backoff_cap.",
                    obj=task.name,
                    id="django_outbox.W011",
                )
            )
    return found


def check_confirms(app: Any, tasks: list[Any]) -> list[checks.CheckMessage]:
    """W014: without publisher confirms, py-amqp's publish returns once the message is
    written to the socket. The relay then marks its event published, and a job that
    published its retry or deferral acks the message it ran from: a broker that fails
    before it has the new message loses the job with nothing left to publish it again.
    With ``confirm_publish`` each publish waits for the broker's confirm (a quorum
    queue's, once a majority holds it). On Redis the reply to the write is the confirm."""
    url = str(app.conf.broker_url or "")
    if not tasks or not url.startswith(RABBITMQ_URL_SCHEMES):
        return []
    if (app.conf.broker_transport_options or {}).get("confirm_publish"):
        return []
    return [
        checks.Warning(
            f"Celery app {app.main!r} publishes to RabbitMQ without publisher confirms: "
            "a relayed outbox event is marked published, and a retry's or deferral's "
            "message replaces the one it ran from, before the broker has it",
            hint="Set CELERY_BROKER_TRANSPORT_OPTIONS = {'confirm_publish': True} "
            "(each publish then waits for the broker's confirm).",
            id="django_outbox.W014",
        )
    ]


def check_prepared_messages(app: Any) -> list[checks.CheckMessage]:
    """E009: a prepared message (``django_outbox.outbox.prepared``) is the bytes kombu's
    Redis transport pushes; with another broker the writer would store none and spend
    nothing, so the setting would say what is not happening."""
    url = str(app.conf.broker_url or "")
    if not settings.outbox_prepared_messages or url.startswith(REDIS_URL_SCHEMES):
        return []
    scheme = url.split("://", 1)[0] if "://" in url else "none"
    return [
        checks.Error(
            f"EXPLICIT_OUTBOX_PREPARED_MESSAGES is on, and Celery app {app.main!r} has a "
            f"{scheme!r} broker: prepared messages are kombu's Redis envelope, for a "
            "Redis broker only",
            hint="Set EXPLICIT_OUTBOX_PREPARED_MESSAGES = False (the relay then builds "
            "every message), or use a Redis broker.",
            id="django_outbox.E009",
        )
    ]


def _redis_visibility_timeout(app: Any) -> float | None:
    url = str(app.conf.broker_url or "")
    if not url.startswith(REDIS_URL_SCHEMES):
        return None
    options = app.conf.broker_transport_options or {}
    return float(options.get("visibility_timeout", REDIS_DEFAULT_VISIBILITY_TIMEOUT))


def check_visibility(app: Any, tasks: list[Any]) -> list[checks.CheckMessage]:
    backstop = _redis_visibility_timeout(app)
    if backstop is None:
        return []
    messages: list[checks.CheckMessage] = []
    sweep = redis_sweep(app.conf.broker_transport_options or {})
    shortest = min((t.contract.visibility_timeout for t in tasks), default=None)
    if shortest is not None and sweep > shortest:
        messages.append(
            checks.Warning(
                f"the Redis transport looks for expired leases every {sweep:g}s, longer than "
                f"the shortest task lease ({shortest:g}s): a dead worker's job waits for the "
                "sweep, not for its own visibility_timeout",
                hint="Set broker_transport_options unacked_restore_interval=1 and "
                "unacked_restore_throttle=1.",
                id="django_outbox.W002",
            )
        )
    for task in sorted(tasks, key=lambda t: t.name):
        contract = task.contract
        if contract.visibility_timeout > backstop:
            messages.append(
                checks.Error(
                    f"task {task.name} declares visibility_timeout="
                    f"{contract.visibility_timeout:g}s but the Redis broker's "
                    f"visibility_timeout is {backstop:g}s: the broker would redeliver the "
                    "task to a second worker while the first still runs",
                    hint="Raise broker_transport_options['visibility_timeout'] to at least "
                    f"{contract.visibility_timeout:g}, or shorten the task's lease.",
                    obj=task.name,
                    id="django_outbox.E003",
                )
            )
        if contract.retry.backoff_cap > backstop:
            messages.append(
                checks.Warning(
                    f"task {task.name} may wait up to backoff_cap="
                    f"{contract.retry.backoff_cap:g}s before a retry, longer than the Redis "
                    f"broker's visibility_timeout of {backstop:g}s: the waiting retry "
                    "would be redelivered to another worker meanwhile",
                    hint="Lower backoff_cap below the broker visibility_timeout.",
                    obj=task.name,
                    id="django_outbox.W001",
                )
            )
    return messages
