"""Guarded writes: a write that carries a fencing token or a version refuses to go back.

A holder can lose its lock without knowing it (a GC pause, SIGSTOP, a slow downstream
past the TTL); a second holder takes the lock with a larger token and writes. When the
first wakes up, its write must not overwrite the newer one. Events for one entity can
arrive out of order ("cancelled" before "created", an old balance after a new one);
the older must not win. In both cases the row keeps the token or version of its last
write, and the update only applies where that is not newer:

    fenced_update(Profile.objects.filter(user_id=123), token=fence, data=rebuilt)
    versioned_update(Order.objects.filter(id=7), version=event.sequence, status="paid")
"""

from __future__ import annotations

from typing import Any

from django.db.models import Q, QuerySet

from celery_explicit.errors import StaleFencingToken, StaleVersion


def fenced_update(
    queryset: QuerySet[Any], *, token: int, field: str = "fencing_token", **values: Any
) -> int:
    """Update the rows whose ``field`` is NULL or <= ``token``; store ``token`` there.

    Returns the number of rows updated. Raises ``StaleFencingToken`` when rows match the
    queryset but each already carries a larger token: a newer holder wrote first. The
    same holder may write again with its own token.
    """
    updated, newest = _guarded_update(queryset, field, token, allow_equal=True, values=values)
    if updated == 0 and newest is not None:
        raise StaleFencingToken(str(queryset.model._meta.label), token=token, current=newest)
    return updated


def versioned_update(
    queryset: QuerySet[Any], *, version: int, field: str = "version", **values: Any
) -> int:
    """Apply a write carrying ``version`` only where the stored version is older (or NULL).

    Returns the number of rows updated: 0 when the row already has this version (a
    duplicate event, harmless). Raises ``StaleVersion`` when the row has a newer one:
    an older event arrived late and must not win.
    """
    updated, newest = _guarded_update(queryset, field, version, allow_equal=False, values=values)
    if updated == 0 and newest is not None and newest > version:
        raise StaleVersion(str(queryset.model._meta.label), version=version, current=newest)
    return updated


def _guarded_update(
    queryset: QuerySet[Any],
    field: str,
    number: int,
    *,
    allow_equal: bool,
    values: dict[str, Any],
) -> tuple[int, int | None]:
    """(rows updated, the newest stored number when none was updated, else None)."""
    older = Q(**{f"{field}__lte" if allow_equal else f"{field}__lt": number})
    updated = queryset.filter(Q(**{f"{field}__isnull": True}) | older).update(
        **{field: number}, **values
    )
    if updated:
        return int(updated), None
    newest = queryset.order_by(f"-{field}").values_list(field, flat=True).first()
    return 0, None if newest is None else int(newest)
