"""A renamed key never applies an effect twice: every key a job was known by is checked.

The effect ledger finds a duplicate by its idempotency key. A deploy that renames a
task's key template (``cap:{ref}`` to ``payment:{ref}:capture``) gives the same effect
a second name, and without more the ledger would apply it again:

- a copy published before the deploy and delivered after it (a redelivery after a
  kill, a retry, a deferral) carries the old key in its headers, and the worker renders
  the new one from the arguments;
- a duplicate published after the deploy of a job applied before it carries the new
  key, and only the old one is in the ledger;
- during a rolling deploy a worker of the old version renders the old key for a job
  the new version applied under the new one.

So a job's effect is checked against, and recorded under, every name it has:

- the key of record, rendered by this worker from the arguments (the ledger claims it);
- the key the message was published with (``idempotency_key`` header), when it
  differs: logged, counted (``explicit_key_mismatch_total``) and stored on the
  attempt row (``published_key``);
- the keys the task's earlier templates render from the same arguments: each worker
  records its tasks' templates when it starts (``django_outbox.KeyTemplate``), and
  warns when one changed, naming the task, both templates and the jobs still in
  flight under the old one.

The other names are checked in the effect's own transaction; when one is in the ledger
the effect is ``done`` (a duplicate), and when none is, the effect commits with a
ledger row for each of them too, so an older worker finds it under the name it knows.
A job without another name costs nothing more.

Only string templates have a history: a key callable is code, and a change to it is
not seen here (the published key still is).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_explicit import job_log, keys, metrics, store
from celery_explicit.conf import settings
from celery_explicit.errors import BadInput
from celery_explicit.headers import KEY_HEADER

logger = job_log.get_logger("celery_explicit.key_history")

#: Earlier templates of a task kept in view (the most recent first): enough for a
#: rename and the rename of a rename; older ones stop being checked.
MAX_EARLIER = 3

#: Per process: the earlier templates of each task, read once from the store.
_earlier: dict[str, tuple[str, ...]] = {}


def published_key(task_name: str, request: Any) -> str | None:
    """The key the message was published with, or None when it carries none.

    A header that is not a non-empty string of at most ``MAX_KEY_LENGTH`` characters
    is the sender's mistake, not a key: refused as bad input (never trusted, never
    stored as the effect's name).
    """
    value = getattr(request, KEY_HEADER, None)
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > keys.MAX_KEY_LENGTH:
        raise BadInput(
            task_name,
            f"message header {KEY_HEADER!r} is not a key: {str(value)[:60]!r}",
        )
    return value


def earlier_templates(task_name: str, current: str) -> tuple[str, ...]:
    """The task's earlier key templates (most recent first), read once per process;
    ``current`` is its template now ("" for a key callable)."""
    from django.db import Error as DatabaseError

    found = _earlier.get(task_name)
    if found is None:
        try:
            found = tuple(store.get().earlier_key_templates(task_name, current)[:MAX_EARLIER])
        except DatabaseError as exc:
            # Read again at the next job; this one is still checked under the key it
            # was published with.
            logger.warning("could not read the earlier key templates: %s", exc)
            return ()
        _earlier[task_name] = found
    return found


def other_keys(
    task_name: str,
    declaration: keys.KeyDeclaration,
    key: str,
    published: str | None,
    given: Mapping[str, Any],
) -> tuple[str, ...]:
    """Every other name of this job's effect: the published key when it differs from
    ``key``, then what each earlier template renders from ``given``.

    An earlier template whose fields these arguments lack is not this job's name.
    """
    current = declaration if isinstance(declaration, str) else ""
    earlier = earlier_templates(task_name, current)
    if (published is None or published == key) and not earlier:
        return ()  # the common case: one name, and no switch to read
    if not settings.key_history:
        return ()
    names: list[str] = []
    if published is not None and published != key:
        names.append(published)
        metrics.key_mismatches.labels(task_name).inc()
        logger.warning(
            "published with key %r, rendered %r by this worker: checked and recorded "
            "under both (the key template changed between publish and run)",
            published,
            key,
            extra={"idempotency_key": key, "published_key": published},
        )
    for template in earlier:
        try:
            rendered = keys.render_key(task_name, template, given)
        except BadInput:
            continue
        if rendered != key and rendered not in names:
            names.append(rendered)
    return tuple(names)


def on_worker_ready(sender: Any = None, **_: Any) -> None:
    """``worker_ready``: record each ExplicitTask's key template; warn for a changed one.

    A failure to record is logged, never fatal: the ledger still checks the published
    key of every message, and the next start records the templates.
    """
    from django.db import Error as DatabaseError

    app = getattr(sender, "app", None)
    if app is None:
        return
    current = {
        name: template
        for name, task in app.tasks.items()
        if isinstance(template := getattr(task, "idempotency_key", None), str)
        and getattr(task, "contract", None) is not None
    }
    try:
        renames = store.get().record_key_templates(current)
    except DatabaseError as exc:
        logger.warning("could not record the tasks' key templates: %s", exc)
        return
    # The pool's processes read the templates at their first job, after this.
    for rename in renames:
        logger.warning(
            "task %s: idempotency_key template changed from %r to %r; %d job(s) "
            "published under the old one are not finished yet. Effects applied under "
            "either template are found under both (celery_explicit.key_history).",
            rename.task_name,
            rename.old,
            rename.new,
            rename.in_flight,
            extra={"task": rename.task_name},
        )
