"""Tasks for the keyed rate limit's tests (tests/fault/test_rate_limit.py): each start
is written down with the Redis server's clock, one clock for every worker."""

from __future__ import annotations

from celery_explicit import ExplicitTask, RateLimit
from tests.celery_app import app

#: Five starts a second per account.
API = RateLimit("test-api:{account}", 5, per=1.0)


def record_start(tag: str, account: str, slot: str = "") -> None:
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    seconds, micros = client.time()
    client.rpush(f"{tag}:starts", f"{account}|{seconds * 1000 + micros // 1000}|{slot}")


class CallLimitedApi(ExplicitTask):
    """Calls an API that allows five calls a second per account."""

    name = "tests.call_limited_api"
    idempotency_key = "api-call:{tag}:{job}"
    rate_limit = API
    visibility_timeout = 10
    expected_duration = 1
    retry_on = ()
    fail_on = ()

    def run(self, account: str, job: int, tag: str) -> None:
        # The start it was reserved, if it was deferred: how late it came back.
        record_start(tag, account, str(getattr(self.request, "explicit_rate_slot", "") or ""))


@app.task(name="tests.call_api_celery_rate_limit", rate_limit="5/s", acks_late=True)
def call_api_celery_rate_limit(account: str, job: int, tag: str) -> None:
    """Negative control: Celery's own rate_limit, which each worker keeps for itself."""
    record_start(tag, account)


app.register_task(CallLimitedApi())
