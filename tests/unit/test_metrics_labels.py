"""A metric's children are kept at hand only for label values accepted as given.

``_Bounded.labels`` remembers the child of a combination whose ``task`` (and ``lock``)
values passed their check unchanged, so a job's metrics skip the check after the first
time. What it must not do: remember a refusal (a task name labelled ``unknown`` before
the task is registered stays ``unknown`` after, a lock family refused as ``other``),
hand a value the child of another that is equal to it but prints differently (``1`` and
``True``, a ``(str, Enum)`` member and its value: prometheus_client keys by ``str()``),
hand out a child prometheus_client no longer holds (after ``clear``, ``remove`` or
``remove_by_labels``), or grow past ``MAX_ACCEPTED``.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Iterator, Sequence

import pytest
from prometheus_client import CollectorRegistry

from celery_explicit import metrics, worker_metrics
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


def _series(counter: metrics._Counter) -> set[Sequence[str]]:
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

    counter.remove_by_labels({"task": name})
    assert (name, "done") not in counter._metrics
    last = counter.labels(name, "done")
    assert last is not again
    assert counter._metrics[(name, "done")] is last


class Outcome(str, enum.Enum):  # noqa: UP042 - the mixin prints differently from StrEnum
    DONE = "done"


def test_equal_values_that_print_differently_are_told_apart() -> None:
    counter = metrics._Counter(
        "explicit_test_plain_labels_total", "A test's own.", ["code"],
        registry=CollectorRegistry(),
    )  # fmt: skip
    one = counter.labels("1")
    assert counter.labels(1)._labelvalues == ("1",)
    assert counter.labels(True)._labelvalues == ("True",)
    assert counter.labels(1.0)._labelvalues == ("1.0",)
    done = counter.labels("done")
    assert counter.labels(Outcome.DONE)._labelvalues == (str(Outcome.DONE),)
    assert counter.labels(Outcome.DONE) is not done
    assert counter.labels("1") is one
    # Only the str values were kept.
    assert set(counter._accepted) == {("1",), ("done",)}


def test_a_lock_family_is_kept_once_accepted_and_other_never(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(metrics, "_lock_families", set())
    monkeypatch.setattr(metrics, "MAX_LOCK_FAMILIES", 1)
    gauge = metrics._Gauge(
        "explicit_test_lock_labels", "A test's own.", ["lock"], registry=CollectorRegistry()
    )
    accepted = gauge.labels("payments")
    assert gauge.labels("payments") is accepted
    assert gauge.labels("refunds")._labelvalues == (metrics.OTHER_LOCKS,)
    assert gauge.labels("refunds")._labelvalues == (metrics.OTHER_LOCKS,)
    assert set(gauge._accepted) == {("payments",)}


def test_a_kept_child_is_still_the_one_exported_after_the_switch_to_files(
    counter: metrics._Counter,
) -> None:
    # worker_metrics re-creates every child's value in place at worker start: the
    # child kept here must still be the one prometheus_client holds and exports.
    name = next(iter(settings.celery_app().tasks))
    kept = counter.labels(name, "done")
    worker_metrics._recreate_values(counter)
    kept.inc(3)
    assert counter.labels(name, "done") is kept
    assert counter._metrics[(name, "done")] is kept
    [family] = list(counter.collect())
    assert [(s.labels, s.value) for s in family.samples if s.name.endswith("_total")] == [
        ({"task": name, "outcome": "done"}, 3.0)
    ]


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
