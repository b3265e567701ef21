"""The ledger's own literal writer (``django_outbox.store.ledger._RoundTrips._quote``) against
PostgreSQL: every value reads back as itself, exactly as through psycopg's ``mogrify``,
and a value it does not write falls back to psycopg (a NUL byte is refused there).

Generated text covers quotes, backslashes, ``E''``-looking prefixes, ``$$`` and every
plane of Unicode: a literal that reads back as something else would be an injection.
"""

from __future__ import annotations

import datetime as dt
import math

import psycopg
import pytest
from django.db import connection, transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_outbox.db import libpq as round_trips_module
from django_outbox.store import ledger

pytestmark = pytest.mark.django_db

TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))


def round_trips() -> ledger._RoundTrips:
    connection.ensure_connection()
    return ledger._RoundTrips(round_trips_module.RoundTrips(connection, connection.connection))


def read_back(sql: str) -> object:
    with connection.cursor() as cursor:
        cursor.execute(sql)  # no parameters: no placeholder parsing either
        return cursor.fetchone()[0]


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=TEXT)
def test_text_reads_back_as_itself(value: str) -> None:
    quoter = round_trips()
    assert ledger._literals([value], quoter._escape) is not None
    assert read_back(quoter._quote("SELECT %s::text", [value])) == value


@pytest.mark.parametrize(
    "value",
    [
        "it's",
        "\\",
        "\\'; DROP TABLE x; --",
        "E'\\x41'",
        "$$",
        "%s",
        "%%",
        "100%",
        "order:ORD-1003:ship; DROP TABLE x --",
        "$1 $$ {} [] <> | # * ! ? ~ ^ & () = + , @ /",
        "\u00e9\u4e2d\U0001f600",
        "",
    ],
)
def test_hostile_text_is_one_literal(value: str) -> None:
    quoter = round_trips()
    assert read_back(quoter._quote("SELECT %s::text", [value])) == value


@pytest.mark.parametrize(
    ("value", "cast"),
    [
        (None, "text"),
        (True, "boolean"),
        (False, "boolean"),
        (0, "bigint"),
        (-(2**62), "bigint"),
        (1.5, "float8"),
        (1e-05, "float8"),
        (-3.25e300, "float8"),
        (dt.datetime(2026, 11, 30, 18, 0, 0, 123456, tzinfo=dt.UTC), "timestamptz"),
        (
            dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone(dt.timedelta(hours=-5))),
            "timestamptz",
        ),
    ],
)
def test_other_values_read_back_as_themselves(value: object, cast: str) -> None:
    quoter = round_trips()
    assert ledger._literals([value], quoter._escape) is not None
    assert read_back(quoter._quote(f"SELECT %s::{cast}", [value])) == value


@pytest.mark.parametrize(
    "value", [math.nan, math.inf, dt.datetime(2026, 1, 1), "a\x00b", b"bytes", 10**30]
)
def test_what_it_does_not_write_goes_to_psycopg(value: object) -> None:
    quoter = round_trips()
    if value == 10**30:
        # An int too large for bigint is still an int: written as digits, refused by
        # the server's cast as it would be through psycopg.
        assert ledger._literals([value], quoter._escape) == (str(value),)
        return
    assert ledger._literals([value], quoter._escape) is None
    if value == "a\x00b":
        with pytest.raises(psycopg.DataError, match="NUL"), transaction.atomic():
            quoter._quote("SELECT %s::text", [value])
        return
    assert quoter._quote("SELECT %s", [value]) == quoter._mogrify("SELECT %s", [value])
