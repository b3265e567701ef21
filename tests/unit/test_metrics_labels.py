"""A metric's children are kept at hand only for label values accepted as given.

``_Bounded.labels`` remembers the child of a combination whose ``task`` (and ``lock``)
values passed their check unchanged, so a job's metrics skip the check after the first
time. What it must not do: remember a refusal (a task name labelled ``unknown`` before
the task is registered stays ``unknown`` after), hand out a child prometheus_client no
longer holds (after ``clear`` or ``remove``), or grow past ``MAX_ACCEPTED``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from celery_explicit import metrics
from celery_explicit.conf import settings


@pytest.fixture
def counter() -> metrics._Counter:
    return metrics._Counter(
        "explicit_test_labels_total", "A test's own.", ["task", "outcome"],
        registry=CollectorRegistry(),
    )  # fmt: skip


@pytest.fixture
def new_name() -> Iterator[str]:
    name = f"tests.unregistered_{uuid.uuid4().hex[:8]}"
    yield name
    settings.celery_app().tasks.pop(name, None)


def _series(counter: metrics._Counter) -> set[tuple[str, ...]]:
    return set(counter._metrics)


def test_an_accepted_combination_is_the_child_prometheus_holds(
    counter: metrics._Counter,
) -> None:
    name = next(iter(settings.celery_app().tasks))
    first = counter.labels(name, "done")
    first.inc()
    assert counter.labels(name, "done") is first
    assert counter._metrics[(name, "done")] is first
    assert counter._accepted == {(name, "done"): first}
    assert counter.labels(name, "failed") is not first


def test_a_refused_name_is_checked_again_once_the_task_is_registered(
    counter: metrics._Counter, new_name: str
) -> None:
    assert counter.labels(new_name, "done")._labelvalues == (metrics.UNKNOWN_TASK, "done")
    assert counter.labels(new_name, "done")._labelvalues == (metrics.UNKNOWN_TASK, "done")
    assert counter._accepted == {}  # the refusal is not remembered

    def registered_late() -> None:
        pass

    settings.celery_app().task(name=new_name)(registered_late)
    assert counter.labels(new_name, "done")._labelvalues == (new_name, "done")
    assert _series(counter) == {(metrics.UNKNOWN_TASK, "done"), (new_name, "done")}


def test_clear_and_remove_forget_the_children_kept(counter: metrics._Counter) -> None:
    name = next(iter(settings.celery_app().tasks))
    kept = counter.labels(name, "done")
    counter.clear()
    fresh = counter.labels(name, "done")
    assert fresh is not kept
    assert counter._metrics[(name, "done")] is fresh

    counter.remove(name, "done")
    assert (name, "done") not in counter._metrics
    again = counter.labels(name, "done")
    assert again is not fresh
    assert counter._metrics[(name, "done")] is again


def test_keyword_labels_and_a_wrong_count_go_the_checked_way(
    counter: metrics._Counter, new_name: str
) -> None:
    assert counter.labels(task=new_name, outcome="done")._labelvalues == (
        metrics.UNKNOWN_TASK,
        "done",
    )
    with pytest.raises(ValueError, match="Incorrect label count"):
        counter.labels(new_name)
    with pytest.raises(ValueError, match="both"):
        counter.labels(new_name, outcome="done")


def test_no_more_than_max_accepted_are_kept(
    counter: metrics._Counter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics, "MAX_ACCEPTED", 3)
    name = next(iter(settings.celery_app().tasks))
    children = [counter.labels(name, f"outcome-{i}") for i in range(6)]
    assert len(counter._accepted) == 3
    # Past the bound each combination is still the one child prometheus_client holds.
    assert [counter.labels(name, f"outcome-{i}") for i in range(6)] == children
    assert all(counter._metrics[(name, f"outcome-{i}")] is c for i, c in enumerate(children))
