"""Tasks the tests run in real worker processes."""

from __future__ import annotations

import os
import signal
import time

from django.db.models import F

from celery_explicit import Downstream, ExplicitTask, RetryAfter, effect
from tests.celery_app import app
from tests.testapp.models import Counter


class TransientError(Exception):
    pass


class ThrottledError(Exception):
    def __init__(self, retry_after: float) -> None:
        self.retry_after = retry_after
        super().__init__(f"throttled for {retry_after}s")


class Increment(ExplicitTask):
    name = "tests.increment"
    idempotency_key = "counter:{name}:op:{op_id}"
    visibility_timeout = 30
    expected_duration = 1
    retry_on = (TransientError,)
    fail_on = (ValueError,)

    def run(
        self,
        name: str,
        op_id: str,
        amount: int = 1,
        hold: float = 0.0,
        die_after_effect: bool = False,
    ) -> str:
        with self.effect() as eff:
            if eff.done:
                return eff.result_ref
            Counter.objects.filter(name=name).update(value=F("value") + amount)
            # Holding the transaction open widens the window in which a concurrent
            # execution with the same key would slip through, if anything let it.
            time.sleep(hold)
            eff.result_ref = f"{name}+{amount}"
        if die_after_effect:
            # Committed, not yet acked: the worker dies and the broker redelivers.
            os.kill(os.getpid(), signal.SIGKILL)
        return eff.result_ref


@app.task(name="tests.increment_unguarded", acks_late=True, reject_on_worker_lost=True)
def increment_unguarded(
    name: str, op_id: str, amount: int = 1, hold: float = 0.0, die_after_effect: bool = False
) -> None:
    """Negative control: the same update and the same crash, without the ledger."""
    import redis
    from django.conf import settings
    from django.db import transaction

    with transaction.atomic():
        Counter.objects.filter(name=name).update(value=F("value") + amount)
        time.sleep(hold)
    # Die once per operation (a marker in Redis), or the redelivery would die forever.
    if die_after_effect and redis.Redis.from_url(settings.REDIS_URL).set(
        f"died:{name}:{op_id}", 1, nx=True, ex=300
    ):
        os.kill(os.getpid(), signal.SIGKILL)


class AlwaysTransient(ExplicitTask):
    name = "tests.always_transient"
    idempotency_key = "transient:{job}"
    visibility_timeout = 30
    expected_duration = 1
    retry_on = (TransientError,)
    fail_on = ()
    max_attempts = 4
    backoff_base = 0.2
    backoff_cap = 1.0

    def run(self, job: str) -> None:
        raise TransientError(f"downstream timed out for {job}")


class Throttled(ExplicitTask):
    name = "tests.throttled"
    idempotency_key = "throttled:{job}"
    visibility_timeout = 30
    expected_duration = 1
    retry_on = (ThrottledError,)
    fail_on = ()
    max_attempts = 2
    # The computed backoff is at most 0.01 s; the cap leaves room for the downstream's
    # 1.5 s (a retry_after is capped by backoff_cap too).
    backoff_base = 0.01
    backoff_cap = 2.0

    def run(self, job: str) -> None:
        raise ThrottledError(retry_after=1.5)


class RetryThenSucceed(ExplicitTask):
    name = "tests.retry_then_succeed"
    idempotency_key = "flaky:{name}"
    visibility_timeout = 30
    expected_duration = 1
    retry_on = (TransientError,)
    fail_on = ()
    backoff_base = 0.1
    backoff_cap = 0.3

    def run(self, name: str, fail_times: int) -> None:
        if self.request.retries < fail_times:
            raise RetryAfter(0.05) if self.request.retries % 2 else TransientError("flaky")
        with self.effect() as eff:
            if eff.done:
                return
            Counter.objects.filter(name=name).update(value=F("value") + 1)


class RetriesUntilHealed(ExplicitTask):
    """Raises a retryable error until the test heals it (a Redis key); execution N
    first tells the test it started and waits for the test's go-ahead for N (the
    publisher-confirms test makes the broker refuse the retry's message meanwhile)."""

    name = "tests.retries_until_healed"
    idempotency_key = "heal:{name}"
    visibility_timeout = 30
    expected_duration = 1
    retry_on = (TransientError,)
    fail_on = ()
    backoff_base = 0.05
    backoff_cap = 0.1

    def run(self, name: str) -> None:
        import redis
        from django.conf import settings

        client = redis.Redis.from_url(settings.REDIS_URL)
        run = client.rpush(f"started:{name}", os.getpid())
        deadline = time.monotonic() + 30
        while not client.exists(f"go:{name}:{run}") and time.monotonic() < deadline:
            time.sleep(0.05)
        if not client.exists(f"healed:{name}"):
            raise TransientError("not healed yet")
        with self.effect() as eff:
            if eff.done:
                return
            Counter.objects.filter(name=name).update(value=F("value") + 1)


class CancellableShip(ExplicitTask):
    """Ships an order, unless an operator cancelled the job. With a ``tag`` it tells the
    test it started, waits for the test's go-ahead, and notes whether it saw
    ``self.cancelled`` before its effect."""

    name = "tests.cancellable_ship"
    idempotency_key = "cship:{order_id}"
    cancellable = True
    visibility_timeout = 30
    expected_duration = 1
    retry_on = ()
    fail_on = ()

    def run(self, order_id: int, tag: str = "") -> None:
        from tests.testapp.models import OrderState

        if tag:
            _wait_for_go_ahead(tag)
            _client().set(f"saw-cancelled:{tag}", int(self._saw_cancelled()), ex=120)
        with self.effect() as eff:
            if eff.done:
                return
            OrderState.objects.create(order_id=order_id, status="shipped")

    def _saw_cancelled(self) -> bool:
        return self.cancelled


class ShipNotCancellable(CancellableShip):
    """The same task, not declaring ``cancellable``: the cancellation's negative control."""

    name = "tests.ship_not_cancellable"
    idempotency_key = "ncship:{order_id}"
    cancellable = False

    def _saw_cancelled(self) -> bool:
        return False


def _client():  # type: ignore[no-untyped-def]
    import redis
    from django.conf import settings

    return redis.Redis.from_url(settings.REDIS_URL)


def _wait_for_go_ahead(tag: str) -> None:
    client = _client()
    client.rpush(f"started:{tag}", os.getpid())
    deadline = time.monotonic() + 30
    while not client.exists(f"proceed:{tag}") and time.monotonic() < deadline:
        time.sleep(0.05)


class Declined(ExplicitTask):
    name = "tests.declined"
    idempotency_key = "payment:{payment_id}:capture"
    visibility_timeout = 30
    expected_duration = 1
    retry_on = (TransientError,)
    fail_on = (ValueError,)

    def run(self, payment_id: int) -> None:
        raise ValueError(f"card declined for payment {payment_id}")


class Surprising(ExplicitTask):
    name = "tests.surprising"
    idempotency_key = "surprise:{item}"
    visibility_timeout = 30
    expected_duration = 1
    retry_on = (TransientError,)
    fail_on = (ValueError,)

    def run(self, item: str) -> None:
        raise LookupError(f"nobody classified this error for {item}")


class OptionalKey(ExplicitTask):
    name = "tests.optional_key"
    idempotency_key = "thing:{thing_id}"
    visibility_timeout = 30
    expected_duration = 1
    retry_on = ()
    fail_on = ()

    def run(self, thing_id: int | None = None) -> None:
        return None


@app.task(
    base=ExplicitTask,
    name="tests.note",
    idempotency_key="note:{name}",
    visibility_timeout=20,
    expected_duration=1,
    retry_on=(TransientError,),
    fail_on=(ValueError,),
)
def note(name: str, request_id: str = "") -> None:
    """Decorator form without bind=True: the module-level effect() helper."""
    with effect() as eff:
        if eff.done:
            return
        Counter.objects.filter(name=name).update(value=F("value") + 1)


class RecordEvent(ExplicitTask):
    """An upstream event: dedup by its id for a window, effect once by the counter op."""

    name = "tests.record_event"
    idempotency_key = "event:{event_id}:count:{name}"
    dedup_key = "{event_id}"
    dedup_window = 30
    visibility_timeout = 30
    expected_duration = 1
    retry_on = (TransientError,)
    fail_on = ()
    backoff_base = 0.05
    backoff_cap = 0.1

    def run(self, event_id: str, name: str, fail_first: bool = False) -> None:
        if fail_first and self.request.retries == 0:
            raise TransientError("first delivery fails; the retry keeps its dedup claim")
        with self.effect() as eff:
            if eff.done:
                return
            Counter.objects.filter(name=name).update(value=F("value") + 1)


class ShortDedup(ExplicitTask):
    name = "tests.short_dedup"
    idempotency_key = "short:{event_id}"
    dedup_key = "{event_id}"
    dedup_window = 2  # long enough for two back-to-back publishes on a loaded machine
    visibility_timeout = 30
    expected_duration = 1
    retry_on = ()
    fail_on = ()

    def run(self, event_id: str) -> None:
        return None


class SlowShip(ExplicitTask):
    """The article's ShipOrder: a slow downstream, far longer than the lease."""

    name = "tests.slow_ship"
    idempotency_key = "order:{order_id}:ship"
    visibility_timeout = 2
    expected_duration = 1
    retry_on = ()
    fail_on = ()

    def run(self, order_id: str, name: str, seconds: float) -> None:
        import redis
        from django.conf import settings

        # Every execution leaves its worker's pid, before anything else happens.
        redis.Redis.from_url(settings.REDIS_URL).rpush(f"ran:{order_id}", os.getppid())
        time.sleep(seconds)  # the warehouse takes its time
        with self.effect() as eff:
            if eff.done:
                return
            Counter.objects.filter(name=name).update(value=F("value") + 1)


class NestedEffect(ExplicitTask):
    """A handler that wraps its effect in its own atomic() (an outer transaction)."""

    name = "tests.nested_effect"
    idempotency_key = "nested:{name}"
    visibility_timeout = 30
    expected_duration = 1
    retry_on = ()
    fail_on = (ValueError,)

    def run(self, name: str, fail: bool) -> None:
        from django.db import transaction

        with transaction.atomic():
            with self.effect() as eff:
                if eff.done:
                    return
                Counter.objects.filter(name=name).update(value=F("value") + 1)
            if fail:
                raise ValueError("validation failed after the effect, inside the outer block")


class KillsItsWorker(ExplicitTask):
    """A poison message: its handler kills its own pool process every time."""

    name = "tests.kills_its_worker"
    idempotency_key = "poison:{job}"
    visibility_timeout = 30
    expected_duration = 1
    retry_on = ()
    fail_on = ()
    max_deliveries = 3

    def run(self, job: str) -> None:
        import redis
        from django.conf import settings

        redis.Redis.from_url(settings.REDIS_URL).rpush(f"ran:{job}", os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)


class KillsItsWorkerUnlimited(KillsItsWorker):
    """Negative control: the same poison with a limit it never reaches."""

    name = "tests.kills_its_worker_unlimited"
    max_deliveries = 10_000


class Overrun(ExplicitTask):
    """Declares a 1 s maximum run time; ``stubborn`` ignores the soft limit."""

    name = "tests.overrun"
    idempotency_key = "overrun:{job}"
    visibility_timeout = 4
    expected_duration = 0.5
    max_run_time = 1
    retry_on = ()
    fail_on = ()

    def run(self, job: str, stubborn: bool = False) -> None:
        from celery.exceptions import SoftTimeLimitExceeded

        try:
            time.sleep(5)
        except SoftTimeLimitExceeded:
            if not stubborn:
                raise
            time.sleep(5)  # ignores it: the hard limit kills the process


WAREHOUSE = Downstream(
    "test-warehouse", concurrency=1, failure_threshold=3, cool_down=1.5, defer_base=0.2
)
WIDE_WAREHOUSE = Downstream("test-wide-warehouse", concurrency=10, defer_base=0.2)
# Negative control for the breaker: a threshold it never reaches.
NO_BREAKER = Downstream("test-no-breaker", concurrency=1, failure_threshold=10_000, defer_base=0.2)


class CallWarehouse(ExplicitTask):
    """Calls a shared downstream; Redis flags simulate it being down, and record calls."""

    name = "tests.call_warehouse"
    idempotency_key = "warehouse:{job}"
    downstream = WAREHOUSE
    visibility_timeout = 10
    expected_duration = 1
    retry_on = (TransientError,)
    fail_on = ()
    max_attempts = 20
    backoff_base = 0.05
    backoff_cap = 0.2

    def run(self, job: str, hold: float = 0.0) -> None:
        import redis
        from django.conf import settings

        r = redis.Redis.from_url(settings.REDIS_URL)
        family = self.contract.downstream.name if self.contract.downstream else "none"
        inflight = r.incr(f"{family}:inflight")
        try:
            r.rpush(f"{family}:seen-inflight", inflight)
            r.rpush(f"{family}:calls", job)
            time.sleep(hold)
            if r.get(f"{family}:down"):
                raise TransientError(f"{family} timed out")
        finally:
            r.decr(f"{family}:inflight")
        with self.effect() as eff:
            if eff.done:
                return
            Counter.objects.filter(name=job).update(value=F("value") + 1)


class CallWideWarehouse(CallWarehouse):
    """Negative control for the concurrency limit: the same calls, a limit of 10."""

    name = "tests.call_wide_warehouse"
    downstream = WIDE_WAREHOUSE


class CallWarehouseNoBreaker(CallWarehouse):
    name = "tests.call_warehouse_no_breaker"
    downstream = NO_BREAKER


class UnlimitedOverrun(ExplicitTask):
    """Negative control for max_run_time: the same 2 s run with no limit declared."""

    name = "tests.unlimited_overrun"
    idempotency_key = "unlimited:{job}"
    visibility_timeout = 4
    expected_duration = 0.5
    retry_on = ()
    fail_on = ()

    def run(self, job: str) -> None:
        time.sleep(2)


app.register_task(CallWarehouseNoBreaker())
app.register_task(UnlimitedOverrun())
app.register_task(CallWarehouse())
app.register_task(CallWideWarehouse())
app.register_task(Overrun())
app.register_task(KillsItsWorker())
app.register_task(KillsItsWorkerUnlimited())
app.register_task(NestedEffect())
app.register_task(SlowShip())
app.register_task(RecordEvent())
app.register_task(RetriesUntilHealed())
app.register_task(CancellableShip())
app.register_task(ShipNotCancellable())
app.register_task(ShortDedup())
app.register_task(Increment())
app.register_task(AlwaysTransient())
app.register_task(Throttled())
app.register_task(RetryThenSucceed())
app.register_task(Declined())
app.register_task(Surprising())
app.register_task(OptionalKey())


class ShipToAddress(ExplicitTask):
    """Reads the address when it starts, ships to it later: a stale execution ships to
    an old address. The first execution pauses (the test stops its process there); a
    second one waits for the test's go-ahead, so the first wakes up while it runs."""

    name = "tests.ship_to_address"
    idempotency_key = "ship:{order_id}"
    visibility_timeout = 2
    expected_duration = 0.5
    retry_on = ()
    fail_on = ()

    def run(self, order_id: int, tag: str) -> None:
        import redis
        from django.conf import settings

        from tests.testapp.models import OrderState, Profile

        client = redis.Redis.from_url(settings.REDIS_URL)
        address = Profile.objects.get(user_id=order_id).data
        if client.rpush(f"started:{tag}", os.getpid()) == 1:
            # Stopped here by the test, which then sets the key: a stopped process can
            # only see it once it is woken up, so the test is never too late to stop it.
            deadline = time.monotonic() + 30
            while not client.exists(f"stopped:{tag}") and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            deadline = time.monotonic() + 30
            while not client.exists(f"proceed:{tag}") and time.monotonic() < deadline:
                time.sleep(0.05)
        with self.effect() as eff:
            if eff.done:
                return
            OrderState.objects.create(order_id=order_id, status=address[:20])


class HoldsTheLine(ExplicitTask):
    """A long handler that leaves [start, end] of each execution in Redis."""

    name = "tests.holds_the_line"
    idempotency_key = "line:{name}:{op_id}"
    # Outlasts the consumer's reconnect after the test drops every connection (the
    # heartbeat that extends the lease stops while the consumer restarts).
    visibility_timeout = 10
    expected_duration = 1
    retry_on = ()
    fail_on = ()

    def run(self, name: str, op_id: str, seconds: float) -> None:
        import redis
        from django.conf import settings

        client = redis.Redis.from_url(settings.REDIS_URL)
        started = time.time()
        client.rpush(f"started:{op_id}", os.getpid())
        time.sleep(seconds)
        with self.effect() as eff:
            if not eff.done:
                Counter.objects.filter(name=name).update(value=F("value") + 1)
        client.rpush(f"spans:{op_id}", f"{started}:{time.time()}")


class ApplyOrderEvent(ExplicitTask):
    """Writes an order's status from an event, with no version check: only the order in
    which events run decides the final state. Leaves the sequence it applied in Redis."""

    name = "tests.apply_order_event"
    idempotency_key = "order:{order_id}:event:{seq}"
    ordering_key = "order:{order_id}"
    visibility_timeout = 10
    expected_duration = 1
    retry_on = ()
    fail_on = ()

    def run(self, order_id: int, seq: int, tag: str) -> None:
        import random

        import redis
        from django.conf import settings

        from tests.testapp.models import OrderState

        # Workers finish in any order, and an odd event runs longer than the even one after
        # it: two events of one order that run side by side then finish out of order far
        # more often than by chance alone, so the unordered control shows it in every run
        # (with only the uniform sleep it ran all 12 orders in order about once in 30
        # runs). Ordering is decided before the handler runs, so this only makes a
        # misordering likelier where nothing prevents it.
        time.sleep(random.uniform(0.0, 0.05) + (0.06 if seq % 2 else 0.0))
        with self.effect() as eff:
            if eff.done:
                return
            OrderState.objects.update_or_create(order_id=order_id, defaults={"status": str(seq)})
        redis.Redis.from_url(settings.REDIS_URL).rpush(f"applied:{tag}:{order_id}", seq)


class ApplyOrderEventUnordered(ApplyOrderEvent):
    """Negative control: the same handler without an ordering key."""

    name = "tests.apply_order_event_unordered"
    ordering_key = None


app.register_task(ShipToAddress())
app.register_task(HoldsTheLine())
app.register_task(ApplyOrderEvent())
app.register_task(ApplyOrderEventUnordered())


class OrderedOverrun(ExplicitTask):
    """An entity's jobs in order, with a 1 s maximum run time (hard limit at 2 s)."""

    name = "tests.ordered_overrun"
    idempotency_key = "ordered-overrun:{entity}:{job}"
    ordering_key = "overrun:{entity}"
    visibility_timeout = 4
    expected_duration = 0.5
    max_run_time = 1
    retry_on = ()
    fail_on = ()

    def run(self, entity: str, job: str, stubborn: bool = False) -> None:
        import signal

        from celery.exceptions import SoftTimeLimitExceeded

        if not stubborn:
            return
        # Like a handler stuck in C code: it unwinds for neither the soft limit nor the
        # pool's SIGTERM, so only the SIGKILL after it ends the process (no finally).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            time.sleep(5)
        except SoftTimeLimitExceeded:
            time.sleep(5)


app.register_task(OrderedOverrun())


class FanOut(ExplicitTask):
    """Publishes one Increment per name: the jobs it causes carry its correlation id."""

    name = "tests.fan_out"
    idempotency_key = "fan_out:{op_id}"
    visibility_timeout = 30
    expected_duration = 1
    retry_on = (TransientError,)
    fail_on = ()

    def run(self, op_id: str, names: list[str], queue: str) -> None:
        for name in names:
            Increment().apply_async(kwargs={"name": name, "op_id": op_id}, queue=queue)


class CardDeclined(Exception):
    pass


class CapturePayment(ExplicitTask):
    """Declares its card number sensitive; a declined card quotes it in the error."""

    name = "tests.capture_payment"
    idempotency_key = "payment:{payment_id}:capture"
    visibility_timeout = 30
    expected_duration = 1
    retry_on = (TransientError,)
    fail_on = (CardDeclined,)
    sensitive = ("card_number",)

    def run(self, payment_id: int, card_number: str, amount: int = 1) -> None:
        raise CardDeclined(f"card {card_number} declined for payment {payment_id}")


app.register_task(FanOut())
app.register_task(CapturePayment())

# The chaos suite's workload (tests/chaos), registered with the same app.
from tests.chaos import tasks as _chaos_tasks  # noqa: E402, F401


@app.task(name="tests.report_redis_client")
def report_redis_client(token: str) -> None:
    """Write down how this pool process's Redis client talks to Redis: its pid, and
    whether it keeps one connection of its own (``celery_explicit.redis_state``)."""
    from celery_explicit import redis_state

    client = redis_state.client()
    kept = client.connection is not None
    client.set(f"probe:{token}", f"{os.getpid()}|{int(kept)}", ex=60)


class RenamedCapture(ExplicitTask):
    """A capture whose key template and ``run()`` signature change with the deploy:
    ``EXPLICIT_TEST_CAPTURE_VERSION=2`` is the version after it (the key renamed, a
    parameter added with a default). Dies after its commit when told to (``die``)."""

    name = "tests.renamed_capture"
    V2 = os.environ.get("EXPLICIT_TEST_CAPTURE_VERSION") == "2"
    idempotency_key = "payment:{ref}:capture" if V2 else "cap:{ref}"
    visibility_timeout = 10
    expected_duration = 1
    retry_on = ()
    fail_on = ()

    def capture(self, ref: str, die: bool) -> None:
        with self.effect() as eff:
            if not eff.done:
                Counter.objects.filter(name=ref).update(value=F("value") + 1)
        if die and not eff.done:
            os.kill(os.getpid(), signal.SIGKILL)  # committed, not acked

    if V2:

        def run(self, ref: str, die: bool = False, currency: str = "EUR") -> None:
            self.capture(ref, die)
    else:

        def run(self, ref: str, die: bool = False) -> None:
            self.capture(ref, die)


app.register_task(RenamedCapture())


class BookStock(ExplicitTask):
    """A job whose database may be away. It declares nothing about database errors
    (an unclassified error is permanent; two attempts at most): only the outage
    contract keeps it out of the dead letters with its attempts intact. Each start of
    its handler is counted in Redis (the warehouse call a handler makes before its
    effect). Its first ``read_only_first`` effects run in a read-only transaction: the
    server's own SQLSTATE 25006."""

    name = "tests.book_stock"
    idempotency_key = "stock:{ref}"
    visibility_timeout = 30
    expected_duration = 1
    retry_on = (TransientError,)
    fail_on = ()
    max_attempts = 2

    def run(
        self, ref: str, read_only_first: int = 0, hold: float = 0.0, fail: bool = False
    ) -> None:
        from django.db import connection

        from celery_explicit import redis_state

        starts = int(redis_state.client().incr(f"test:starts:{ref}"))
        time.sleep(hold)
        if fail:
            if starts <= read_only_first:
                with connection.cursor() as cursor:
                    cursor.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
            raise LookupError(f"no stock for {ref}")
        with self.effect() as eff:
            if eff.done:
                return
            if starts <= read_only_first:
                with connection.cursor() as cursor:
                    cursor.execute("SET TRANSACTION READ ONLY")
            Counter.objects.filter(name=ref).update(value=F("value") + 1)


app.register_task(BookStock())

# The periodic tasks (tests/fault/test_periodic.py).
from tests.testapp import tasks_periodic as _periodic_tasks  # noqa: E402, F401

# The keyed rate limit's tasks (tests/fault/test_rate_limit.py).
from tests.testapp import tasks_rate_limit as _rate_limit_tasks  # noqa: E402, F401

# The redaction test's tasks (tests/integration/test_redaction_paths.py).
from tests.testapp import tasks_redaction as _redaction_tasks  # noqa: E402, F401
