"""A Celery app whose decorator-declared task lacks its idempotency key (for checks)."""

from celery import Celery

from celery_explicit import ExplicitTask

app = Celery("broken", set_as_current=False)


@app.task(
    base=ExplicitTask,
    shared=False,
    name="tests.broken_missing_key",
    visibility_timeout=10,
    expected_duration=1,
    retry_on=(),
    fail_on=(),
)
def broken(order_id: int) -> None:
    return None
