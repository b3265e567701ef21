"""System checks: what can only be judged with the whole configuration.

``manage.py check`` (and the worker, through Django's start-up) report:

- E001 a task's contract is missing a field or contradicts itself
- E002 a pickle serializer is accepted or used (by name or content type, for tasks
  or results)
- E003 the Redis broker's visibility timeout (the global backstop) is shorter than a
  task's lease, so the broker redelivers that task while it still runs
- E004 ``EXPLICIT_CELERY_APP`` cannot be imported
- E005 the ledger database cannot do ``INSERT ... ON CONFLICT DO NOTHING RETURNING``
- W001 a task's retry delay can outlast the Redis visibility timeout: a retry waiting
  in a worker (an ETA message) would be redelivered to another one meanwhile
- W002 kombu's restore sweep runs less often than a task's lease: a dead worker's job
  waits for the sweep, not for its own lease
- E006 a setting (``EXPLICIT_*``) outside its rule: a range, its choices, its form
- E007 a setting that cannot be read as its type (``"abc"`` for a number)
- E008 a setting against another (a reconcile horizon at or below ``AFTER``, a backoff
  cap below its base)
- W013 an ``EXPLICIT_*`` Django setting that no setting reads (a misspelling), with the
  names it is close to
- W005 the installed Celery or kombu is outside the tested ranges: a worker refuses to
  start, or starts only because ``EXPLICIT_ALLOW_UNTESTED_VERSIONS`` overrides it
- W010 (``check --database default``) a task's key template changed since a worker
  last started with it: what the rename does, and the jobs still in flight
- W011 RabbitMQ: a task's lease or retry delay is as long as the broker's
  ``consumer_timeout``, which closes the channel of a message held that long
- W012 Celery's soft shutdown (``worker_soft_shutdown_timeout``) is shorter than a
  task's ``expected_duration``: a deploy cuts that job off and it runs again
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from django.apps import AppConfig
from django.core import checks
from django.db import connections

from celery_explicit import versions, worker_steps
from celery_explicit.errors import ContractError
from django_outbox.conf import settings

# kombu's Redis transport default (kombu/transport/redis.py, Channel.visibility_timeout).
REDIS_DEFAULT_VISIBILITY_TIMEOUT = 3600.0


def _loaded_tasks(app: Any) -> list[Any]:
    """Every ExplicitTask of ``app``, its task modules imported; ``ContractError`` for
    the first that does not load.

    Decorator-declared tasks are lazy until the app finalizes; forced here so a
    contract error surfaces in the check, not when the task is first used. (Celery's
    own import_default_modules would run django.setup() again from inside a check;
    importing each installed app's tasks module is what its Django autodiscovery
    does.)
    """
    worker_steps.import_tasks(app)  # each module once: a refused one is not run again
    return _explicit_tasks(app)


Check = Callable[..., list[checks.CheckMessage]]


def reads_settings(check: Check) -> Check:
    """A check that reads our settings says nothing while one of them cannot be read
    as its type: ``check_settings`` reports that one (E007), where reading it here
    would end ``manage.py check`` in a traceback. Every check of ours that reads a
    setting wears it, under ``@checks.register``."""

    @functools.wraps(check)
    def guarded(*args: Any, **kwargs: Any) -> list[checks.CheckMessage]:
        if any(problem.kind == "cast" for problem in settings.problems()):
            return []
        return check(*args, **kwargs)

    return guarded


def _explicit_tasks(app: Any) -> list[Any]:
    from celery_explicit.task import ExplicitTask

    return [t for t in app.tasks.values() if isinstance(t, ExplicitTask)]


@checks.register("django_outbox")
@reads_settings
def check_celery_configuration(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    try:
        app = settings.celery_app()
    except ImportError as exc:
        return [
            checks.Error(
                f"EXPLICIT_CELERY_APP={settings.celery_app_path!r} cannot be imported: {exc}",
                hint="Set it to the dotted path of your Celery app, e.g. 'shop.celery.app'.",
                id="django_outbox.E004",
            )
        ]

    errors: list[checks.CheckMessage] = []
    try:
        tasks = _loaded_tasks(app)
    except ContractError as exc:
        return [
            checks.Error(
                str(exc), hint=_contract_hint(exc), obj=exc.task_name, id="django_outbox.E001"
            )
        ]

    errors += _check_serializers(app)
    errors += _check_visibility(app, tasks)
    errors += _check_consumer_timeout(app, tasks)
    errors += _check_soft_shutdown(app, tasks)
    errors += _check_broker_url(app, tasks)
    errors += _check_unregistered(app)
    return errors


def _check_unregistered(app: Any) -> list[checks.CheckMessage]:
    """A class-based task nobody passed to ``app.register_task()`` does not exist for
    Celery: no worker runs it, and no other check here ever sees it. Looked for among
    the ExplicitTask classes of the installed Django apps (decorator tasks register
    themselves; abstract bases are not tasks)."""
    from django.apps import apps

    from celery_explicit.task import ExplicitTask

    registered = {type(task) for task in app.tasks.values()}
    installed = [config.name for config in apps.get_app_configs()]
    found: list[checks.CheckMessage] = []
    pending = list(ExplicitTask.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls in registered or "contract" not in cls.__dict__ or cls.__dict__.get("_decorated"):
            continue
        module = cls.__module__
        if not any(module == name or module.startswith(name + ".") for name in installed):
            continue
        found.append(
            checks.Warning(
                f"ExplicitTask {module}.{cls.__qualname__} ({cls.contract.task_name}) is not "
                f"registered with Celery app {app.main!r}: no worker runs it",
                hint=f"Add app.register_task({cls.__qualname__}()) after the class.",
                obj=cls.contract.task_name,
                id="django_outbox.W004",
            )
        )
    return found


def _check_broker_url(app: Any, tasks: list[Any]) -> list[checks.CheckMessage]:
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


@checks.register("django_outbox", checks.Tags.database)
@reads_settings
def check_ledger_database(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    if settings.database not in connections:
        return []  # check_settings names the alias (E006)
    connection = connections[settings.database]
    if connection.vendor in ("postgresql", "sqlite"):
        return []
    return [
        checks.Error(
            f"the effect ledger needs INSERT ... ON CONFLICT DO NOTHING RETURNING, which "
            f"database {settings.database!r} ({connection.vendor}) does not offer",
            hint="Use PostgreSQL (or SQLite for a demo) for EXPLICIT_DATABASE.",
            id="django_outbox.E005",
        )
    ]


def _contract_hint(exc: ContractError) -> str:
    if exc.hint:
        return exc.hint
    return (
        f"Fix the declaration of {exc.field!r} on task {exc.task_name}."
        if exc.field
        else f"Fix the declaration of task {exc.task_name}."
    )


def _pickle_names() -> set[str]:
    """Every name and content type under which kombu decodes with pickle: a Celery
    setting may give either (``accept_content=["application/x-python-serialize"]``)."""
    from kombu import serialization

    # kombu's stubs leave out its module-level registry; the registry is kombu's own
    # record of what it decodes, including a serializer registered under another name
    # that decodes with kombu's unpickle.
    registry: Any = serialization.registry  # type: ignore[attr-defined]
    pickle_types = {"application/x-python-serialize"}
    pickle_types.update(
        content_type
        for content_type, decoder in registry._decoders.items()
        if decoder is serialization.unpickle
    )
    names = {
        name for name, content_type in registry.name_to_type.items() if content_type in pickle_types
    }
    return {n.lower() for n in names | pickle_types | {"pickle"}}


def _check_serializers(app: Any) -> list[checks.CheckMessage]:
    conf = app.conf
    pickle = _pickle_names()
    found = []
    for name in (
        "accept_content",
        "result_accept_content",
        "task_serializer",
        "result_serializer",
        "event_serializer",
    ):
        value = conf.get(name)
        values = [value] if isinstance(value, str) else list(value or [])
        allowed = sorted({str(v) for v in values if str(v).strip().lower() in pickle})
        if allowed:
            found.append(f"{name} ({', '.join(allowed)})")
    if not found:
        return []
    return [
        checks.Error(
            f"Celery setting {', '.join(found)} allows the pickle serializer: a pickled "
            "message taken from the broker runs arbitrary code in the worker",
            hint="Use JSON: accept_content=['json'], result_accept_content=['json'], "
            "task_serializer='json', result_serializer='json'.",
            id="django_outbox.E002",
        )
    ]


def _check_consumer_timeout(app: Any, tasks: list[Any]) -> list[checks.CheckMessage]:
    """W011: RabbitMQ closes the channel of a delivery unacknowledged for longer than
    its ``consumer_timeout`` (30 min by default), and every message on it is
    redelivered. With ``acks_late`` a job holds its message while it runs, and a retry
    or deferral waiting for its ETA holds it in the worker too."""
    url = str(app.conf.broker_url or "")
    if not url.startswith(("amqp://", "amqps://", "pyamqp://")):
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


def _check_soft_shutdown(app: Any, tasks: list[Any]) -> list[checks.CheckMessage]:
    """W012: with Celery's soft shutdown on (``worker_soft_shutdown_timeout`` > 0,
    Celery 5.5+), a SIGTERM that Celery treats as a cold shutdown
    (``REMAP_SIGTERM=SIGQUIT``) still lets running jobs finish for that long, then
    ends them; a job expected to run longer is cut off by every deploy and run again
    (docs/howto/deploys.md)."""
    grace = float(app.conf.get("worker_soft_shutdown_timeout") or 0)
    if grace <= 0:
        return []
    found: list[checks.CheckMessage] = []
    for task in sorted(tasks, key=lambda t: t.name):
        expected = task.contract.expected_duration
        if expected > grace:
            found.append(
                checks.Warning(
                    f"task {task.name} expects to run {expected:g}s, longer than "
                    f"worker_soft_shutdown_timeout={grace:g}s: a deploy that stops the "
                    "worker ends the job before it finishes, and it runs again elsewhere",
                    hint=f"Set worker_soft_shutdown_timeout to at least {expected:g} (and "
                    "the deploy's grace period above it), or rely on the warm shutdown.",
                    obj=task.name,
                    id="django_outbox.W012",
                )
            )
    return found


@checks.register("django_outbox", checks.Tags.database)
@reads_settings
def check_key_renames(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """W010: a task whose recorded key templates differ (a rename). Reads the
    database, so only ``check --database <alias>`` runs it (as Django's own)."""
    from django.db import DatabaseError

    from django_outbox.store import key_history

    if settings.database not in (kwargs.get("databases") or ()):
        return []
    try:
        current = {
            t.name: t.contract.idempotency_key
            for t in _loaded_tasks(settings.celery_app())
            if isinstance(t.contract.idempotency_key, str)
        }
        recorded = key_history.renamed()
    except (DatabaseError, ImportError, ContractError):
        return []  # no table yet (before migrate), no app, a bad task: others say so
    found: list[checks.CheckMessage] = []
    for rename in recorded:
        now = current.get(rename.task_name)
        if now is None:
            continue
        # The most recent template other than the one the code declares now.
        old = rename.old if now == rename.new else rename.new
        found.append(
            checks.Warning(
                f"task {rename.task_name}: idempotency_key was {old!r} and is now {now!r}. "
                f"An effect applied under either is found under both, and recorded under "
                f"both when applied; {rename.in_flight} job(s) with a retry pending were "
                "published under the old one",
                hint="Nothing to do for a rename (celery_explicit.key_history); a template "
                "that names another effect needs a new task name instead.",
                obj=rename.task_name,
                id="django_outbox.W010",
            )
        )
    return found


def _redis_visibility_timeout(app: Any) -> float | None:
    url = str(app.conf.broker_url or "")
    if not url.startswith(("redis://", "rediss://", "redis+socket://", "sentinel://")):
        return None
    options = app.conf.broker_transport_options or {}
    return float(options.get("visibility_timeout", REDIS_DEFAULT_VISIBILITY_TIMEOUT))


def _check_visibility(app: Any, tasks: list[Any]) -> list[checks.CheckMessage]:
    backstop = _redis_visibility_timeout(app)
    if backstop is None:
        return []
    messages: list[checks.CheckMessage] = []
    options = app.conf.broker_transport_options or {}
    # kombu's defaults: a sweep every 10 s, scanning on every 10th (celery_explicit.lease).
    sweep = float(options.get("unacked_restore_interval", 10)) * float(
        options.get("unacked_restore_throttle", 10)
    )
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


#: ``Problem.kind`` -> the check id that reports it.
SETTING_CHECK_IDS = {
    "rule": "django_outbox.E006",
    "cast": "django_outbox.E007",
    "relation": "django_outbox.E008",
}


@checks.register("django_outbox")
def check_settings(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """E006/E007/E008: a setting against its rule, its type, or another setting (the
    table is ``celery_explicit.conf.Settings``); W013: an ``EXPLICIT_*`` Django setting
    no setting reads, which would otherwise do nothing at all."""
    found: list[checks.CheckMessage] = [
        checks.Error(
            problem.message,
            hint=problem.hint,
            obj=problem.setting,
            id=SETTING_CHECK_IDS[problem.kind],
        )
        for problem in settings.problems()
    ]
    for name, close in settings.unknown().items():
        found.append(
            checks.Warning(
                f"{name} is set, but no celery-explicit setting has that name: it does nothing",
                hint=(
                    f"Did you mean {' or '.join(close)}?"
                    if close
                    else "The settings are listed in docs/reference.md (Settings)."
                ),
                obj=name,
                id="django_outbox.W013",
            )
        )
    return found


@checks.register("django_outbox")
@reads_settings
def check_versions(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """W005: Celery or kombu outside the tested ranges (``celery_explicit.versions``).

    A warning, not an error: the worker refuses to start by itself
    (``worker_steps.refuse_untested_versions``); with the override set, this is where
    the override stays visible."""
    line = versions.untested_line(versions.installed())
    if line is None:
        return []
    if settings.allow_untested_versions:
        return [
            checks.Warning(
                f"{line}; workers start anyway because EXPLICIT_ALLOW_UNTESTED_VERSIONS is set",
                hint="Install versions in the tested ranges (docs/compatibility.md), then "
                "remove EXPLICIT_ALLOW_UNTESTED_VERSIONS.",
                id="django_outbox.W005",
            )
        ]
    return [
        checks.Warning(
            f"{line}; a worker will refuse to start",
            hint="Install versions in the tested ranges (docs/compatibility.md), or set "
            "EXPLICIT_ALLOW_UNTESTED_VERSIONS = True to start workers anyway.",
            id="django_outbox.W005",
        )
    ]
