"""The Celery app checks: the app, its tasks' contracts, its serializers, its shutdown.

One registered check, ``check_celery_configuration``, imports the app named by
``EXPLICIT_CELERY_APP`` and its task modules once, then hands the app and its
ExplicitTasks to each finding below and to the broker's (``checks.broker``):

- E004 ``EXPLICIT_CELERY_APP`` cannot be imported
- E001 a task's contract is missing a field or contradicts itself
- E002 a pickle serializer is accepted or used (by name or content type, for tasks
  or results)
- W012 Celery's soft shutdown (``worker_soft_shutdown_timeout``) is shorter than a
  task's ``expected_duration``: a deploy cuts that job off and it runs again
- W004 an ExplicitTask class nobody registered with the app: no worker runs it
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.core import checks

from celery_explicit.errors import ContractError
from django_outbox.checks import broker
from django_outbox.checks.reading import loaded_tasks, reads_settings
from django_outbox.conf import settings

__all__ = ["check_celery_configuration"]


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
        tasks = loaded_tasks(app)
    except ContractError as exc:
        return [
            checks.Error(
                str(exc), hint=_contract_hint(exc), obj=exc.task_name, id="django_outbox.E001"
            )
        ]

    errors += _check_serializers(app)
    errors += broker.check_visibility(app, tasks)
    errors += broker.check_consumer_timeout(app, tasks)
    errors += broker.check_confirms(app, tasks)
    errors += broker.check_prepared_messages(app)
    errors += _check_soft_shutdown(app, tasks)
    errors += broker.check_broker_url(app, tasks)
    errors += _check_unregistered(app)
    return errors


def _contract_hint(exc: ContractError) -> str:
    if exc.hint:
        return exc.hint
    return (
        f"Fix the declaration of {exc.field!r} on task {exc.task_name}."
        if exc.field
        else f"Fix the declaration of task {exc.task_name}."
    )


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
