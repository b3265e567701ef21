"""The step protocol: how a mechanism takes part in running a job.

Each mechanism that guards the job path (delivery limit, dedup, ordering, execution
lease, downstream limit) has a step in its own module. Before the handler runs, the
pipeline asks each declared step, in a fixed order, for a decision:

- ``RUN``: go on to the next step (and, after the last, the handler);
- ``Defer(seconds, reason)``: publish the same job again that much later and end this
  delivery, no attempt used (another execution holds the job, it is not this entity's
  turn, the downstream is busy);
- ``Drop(outcome, note)``: end the job here, recorded, nothing published;
- ``DeadLetter(error, outcome)``: keep the message as evidence, never run it;
- ``RetryLater(error, delay)``: the step could not decide (its store is down): retry.

When the delivery ends, however it ended, each declared step's ``after_run`` is called
in reverse order with how it ended and whether the step had let it through
(``entered``), so a step can give back what it took (a downstream slot, the execution
lease) or pass on what the job held (the entity's turn). A step returns its decision
and never acts on it: re-publishing, recording and dead-lettering belong to the
pipeline (``celery_explicit.pipeline``, and ``failures`` for a job that did not
succeed), the only modules that import them.
A step counts its own metric and writes its own log line when it decides.

A step subclasses ``Step`` and overrides only what its mechanism does: the hooks are
no-ops here, and ``declared`` builds the step for every task (a step a task opts into
overrides it to read its own declaration from the contract, and answers None when the
task did not declare it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Self

from celery_explicit.execution import Execution
from celery_explicit.outcomes import Outcome

if TYPE_CHECKING:
    from celery_explicit.contract import Contract


class Run:
    """Go on: this step lets the job through."""

    def __repr__(self) -> str:
        return "RUN"


RUN = Run()


@dataclass(frozen=True)
class Defer:
    seconds: float
    #: Why, for the log line: ``deferred 1.20s: <reason>``.
    reason: str
    log_fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Drop:
    outcome: Outcome
    note: str


@dataclass(frozen=True)
class DeadLetter:
    error: BaseException
    #: The outcome of the attempt and the dead letter's reason share this name.
    name: str


@dataclass(frozen=True)
class RetryLater:
    error: Exception
    delay: float
    #: Record a ``retry_scheduled`` attempt first (False when nothing ran yet that
    #: an operator would look for).
    record: bool = True


Decision = Run | Defer | Drop | DeadLetter | RetryLater


@dataclass
class Job:
    """One delivery on its way through the steps."""

    task_name: str
    request: Any
    execution: Execution


@dataclass(frozen=True)
class Ending:
    """How the delivery ended, as the steps need to know it."""

    #: A retry or a deferral was published, or the message requeued: the job goes on.
    goes_on: bool
    #: The handler raised an error classified as transient (``retry_on``).
    transient_failure: bool = False


class Step:
    """A mechanism's part in running a job; each hook does nothing unless overridden."""

    #: The mechanism's name, as in metrics, logs and docs.
    name: ClassVar[str]

    def __init__(self, task_name: str) -> None:
        self.task_name = task_name

    @classmethod
    def declared(cls, contract: Contract) -> Self | None:
        """This step for the task whose contract this is; None if it declared none."""
        return cls(contract.task_name)

    def before_run(self, job: Job) -> Decision:
        """Whether the job goes on to the next step; see the module docstring."""
        return RUN

    def after_run(
        self, request: Any, execution: Execution | None, ending: Ending, *, entered: bool
    ) -> None:
        """The delivery ended (``ending``); ``entered`` if this step had let it through.

        Give back here what ``before_run`` took. An error raised here is logged by the
        pipeline and does not keep the other steps from giving back theirs."""
        return None
