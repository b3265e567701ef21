"""The pure parts of the logs: a job's prefix and fields, the correlation context, and
redaction of sensitive fields (the worker tests are tests/integration/test_job_logs.py)."""

from __future__ import annotations

import inspect
import logging

import pytest

from celery_explicit import correlation, job_log, sensitive


@pytest.fixture
def records() -> list[logging.LogRecord]:
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    logger = logging.getLogger("tests.job_log")
    handler = Keep()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield seen
    logger.removeHandler(handler)


def test_a_line_inside_a_job_names_it_in_text_and_fields(records) -> None:
    log = job_log.get_logger("tests.job_log")
    token = job_log.bind({"task": "shop.ship", "job_id": "j1", "idempotency_key": "order:5%"})
    try:
        job_log.update(deliveries=2)
        log.info("took %s", "the lock")
        log.warning("no args, 100%")
        log.info("about another job", extra={"job_id": "j2"})
    finally:
        job_log.reset(token)
    log.info("outside any job")
    texts = [r.getMessage() for r in records]
    assert texts == [
        "shop.ship[j1] key=order:5%: took the lock",
        "shop.ship[j1] key=order:5%: no args, 100%",
        "shop.ship[j2] key=order:5%: about another job",
        "outside any job",
    ]
    assert records[0].deliveries == 2 and records[0].job_id == "j1"  # type: ignore[attr-defined]
    assert not hasattr(records[3], "job_id")


def test_the_correlation_id_is_born_once_and_scoped() -> None:
    assert correlation.current() == ""
    born = correlation.for_publish()
    assert len(born) == 32 and born != correlation.for_publish()  # each publish: new
    with correlation.use("req-1") as current:
        assert current == "req-1" and correlation.for_publish() == "req-1"
        with correlation.use(""):  # an empty id: a fresh one, not none
            assert len(correlation.current()) == 32
        assert correlation.current() == "req-1"
    assert correlation.current() == ""


def run(self, payment_id: int, card_number: str, note: str = "") -> None:
    return None


SIG = inspect.signature(run).replace(
    parameters=list(inspect.signature(run).parameters.values())[1:]
)


def test_sensitive_fields_are_redacted_by_name_and_position() -> None:
    args, kwargs = sensitive.redact(("card_number",), SIG, [7, "4111111111111111"], {"note": "x"})
    assert args == [7, "[redacted]"] and kwargs == {"note": "x"}
    args, kwargs = sensitive.redact(("card_number",), SIG, [7], {"card_number": "4111"})
    assert args == [7] and kwargs == {"card_number": "[redacted]"}
    assert sensitive.holds_redacted(args, kwargs) == ["card_number"]


def test_values_are_scrubbed_from_free_text_but_short_ones_are_left() -> None:
    values = sensitive.values_of(
        ("card_number", "note"), SIG, [7, "4111111111111111"], {"note": "ok"}
    )
    assert values == ["4111111111111111"]  # "ok" is too short to scrub safely
    text = "CardDeclined('card 4111111111111111 declined'), repr '4111111111111111'"
    assert "4111" not in sensitive.scrub(text, values)
