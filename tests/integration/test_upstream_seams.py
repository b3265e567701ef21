"""The places where we lean on Celery's and kombu's internals, each checked here.

Each seam has a comment at its use linking the upstream code it depends on; these
tests fail when an upgrade moves or renames what that comment describes, before a
worker in production finds out. Behaviour through each seam is tested where the
mechanism is (test_lease_keeper, test_job_path); here is what upstream must provide.
"""

from __future__ import annotations

import types
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery, Task
from celery.worker import state
from celery.worker.consumer.consumer import Consumer
from django.conf import settings
from kombu import Connection, Queue

from celery_explicit import bootsteps
from celery_explicit.contract import celery_decorator_keys
from celery_explicit.message_lease import unacked_index_key
from celery_explicit.message_lease_keeper import LeaseKeeper


def _code_names(code: types.CodeType) -> Iterator[str]:
    """Every name a function's code refers to, nested functions included."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def test_the_consumer_still_calls_on_decode_error_for_a_body_it_cannot_decode() -> None:
    """bootsteps.RecordUndecodable wraps ``Consumer.on_decode_error``: it must exist
    and be what the task handler calls when a body does not decode."""
    assert callable(Consumer.on_decode_error)
    assert "on_decode_error" in set(_code_names(Consumer.create_task_handler.__code__))


def test_scheduled_requests_are_listed_apart_by_the_worker_state() -> None:
    """The lease keeper leases ETA/countdown messages (retries, deferrals) through
    ``celery.worker.state.scheduled_requests`` (Celery 5.7)."""
    assert hasattr(state, "scheduled_requests")
    assert hasattr(state, "reserved_requests")


def test_celery_decorator_keys_are_read_off_celery_itself() -> None:
    """What ``@app.task`` puts in a task's class dict, found by the contract's probe,
    equals what Celery puts there for a plain task today (not a copied list)."""
    seen: dict[str, object] = {}

    class Spy(Task):  # type: ignore[type-arg]
        def __init_subclass__(cls, **kwargs: object) -> None:
            super().__init_subclass__(**kwargs)
            seen.update(cls.__dict__)

    app = Celery(f"seam-{uuid.uuid4().hex[:6]}", set_as_current=False)

    def handler(order_id: int) -> None:
        return None

    app.task(base=Spy, name="seam.handler", lazy=False)(handler)
    assert celery_decorator_keys() == frozenset(seen)
    assert {"app", "name", "run"} <= celery_decorator_keys()


def test_our_consumer_steps_are_added_once_per_app() -> None:
    app = Celery(f"seam-{uuid.uuid4().hex[:6]}", set_as_current=False)
    before = set(app.steps["consumer"])
    bootsteps.install(app)
    bootsteps.install(app)
    added = set(app.steps["consumer"]) - before
    assert added == {
        bootsteps.RecordUndecodable,
        bootsteps.RefuseMisshapen,
        bootsteps.ArchiveDeadChildMetrics,
        LeaseKeeper,
    }


@pytest.mark.parametrize("global_prefix", ["", "seam-prefix:"])
def test_kombu_keeps_unacked_messages_in_the_index_the_keeper_moves(
    redis_client, global_prefix
) -> None:
    """kombu's Redis channel scores each unacked message in a sorted set named by
    ``unacked_index_key`` under its ``global_keyprefix``, by delivery time, and reads
    connections from ``pool``: what ``celery_explicit.message_lease`` addresses."""
    suffix = uuid.uuid4().hex[:8]
    options = {
        "unacked_index_key": f"explicit-test:index:{suffix}",
        "unacked_key": f"explicit-test:unacked:{suffix}",
        "global_keyprefix": f"{global_prefix}{suffix}:" if global_prefix else "",
    }
    with Connection(settings.REDIS_URL, transport_options=options) as connection:
        channel = connection.default_channel
        assert channel.pool is not None
        queue = Queue(f"q-seam-{suffix}", channel=channel)
        queue.declare()
        connection.Producer().publish({"n": 1}, routing_key=queue.name)
        message = queue.get(no_ack=False)
        assert message is not None
        try:
            index = unacked_index_key(channel)
            assert index == options["global_keyprefix"] + options["unacked_index_key"]
            score = redis_client.zscore(index, message.delivery_tag)
            assert score is not None  # scored by delivery time, where we look for it
        finally:
            message.ack()
            redis_client.delete(options["global_keyprefix"] + queue.name)


# What the relay's copy of Celery's send path (django_outbox.outbox.relay.celery_send)
# copies: the names each upstream function refers to in Celery 5.7.0. A new step in
# one of them (a new option, a new setting read) changes its set: re-read the function
# against the copy, then update the set here.
SEND_PATH_NAMES = {
    "Task.apply_async": (
        "celery.app.task:Task.apply_async",
        {
            "AsyncResult", "AttributeError", "ValueError", "__header__", "__v2_compat__",
            "_dump_pydantic_arguments", "_get_app", "_get_exec_options", "apply", "conf",
            "denied_join_result", "dict", "dumps", "get", "ignore_result", "loads", "name",
            "producer_or_acquire", "send_task", "serialization", "serializer", "setdefault",
            "shadow_name", "soft_time_limit", "task_always_eager", "task_serializer",
            "time_limit", "typing", "uuid",
        },
    ),
    "Celery.send_task": (
        "celery.app.base:Celery.send_task",
        {
            "AlwaysEagerIgnored", "AsyncResult", "Exchange", "KeyError", "Producer",
            "_OMITTED", "_get_exec_options", "_reraise_as_library_errors", "_tasks",
            "add_trail", "amqp", "backend", "calculate_routing_key", "callable", "conf",
            "connection", "connections", "create_task_message", "current_worker_task",
            "datetime", "delivery_info", "detect_quorum_queues", "dict", "driver_type",
            "exchange", "get", "getattr", "hasattr", "id", "ignored", "inspect", "int",
            "isinstance", "ismethod", "isoparse", "items", "logger", "maybe_list", "name",
            "now", "on_task_call", "pop", "producer_or_acquire", "producer_pool", "request",
            "root_id", "route", "router", "routing_key", "send_task_message", "setdefault",
            "str", "subtract_datetimes", "task_always_eager", "task_inherit_parent_priority",
            "task_send_sent_event", "thread_oid", "total_seconds", "transport", "type",
            "uuid", "warn", "warning", "warnings",
        },
    ),
    "Router.route": (
        "celery.app.routes:Router.route",
        {
            "app", "conf", "expand_destination", "lookup_route", "lpmerge", "routes",
            "task_default_queue",
        },
    ),
}  # fmt: skip


@pytest.mark.parametrize("function", sorted(SEND_PATH_NAMES))
def test_celerys_send_path_takes_the_steps_the_relay_copies(function: str) -> None:
    import importlib

    where, names = SEND_PATH_NAMES[function]
    module, qualname = where.split(":")
    owner, name = qualname.split(".")
    code = getattr(getattr(importlib.import_module(module), owner), name).__code__
    assert set(_code_names(code)) == names


def test_the_relay_send_path_reads_what_celery_and_kombu_still_have() -> None:
    """``celery_send`` reads a task's exec options, its v2 and pydantic flags, the
    router's parts, the argument reprs' sizes, and kombu's error translation."""
    from tests.celery_app import app
    from tests.testapp.tasks import note

    task = app.tasks[note.name]
    assert isinstance(task._get_exec_options(), dict)
    assert task.__v2_compat__ is False
    assert task._dump_pydantic_arguments is None
    router = app.amqp.router
    assert isinstance(router.routes, list | tuple)
    assert callable(router.expand_destination)
    assert isinstance(app.amqp.argsrepr_maxsize, int)
    assert isinstance(app.amqp.kwargsrepr_maxsize, int)
    assert callable(app.amqp.create_task_message) and callable(app.amqp.send_task_message)
    assert callable(Connection._reraise_as_library_errors)
