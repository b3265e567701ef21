"""Fenced writes: a write that carries a fencing token refuses to go backwards.

A holder can lose its lock without knowing it (a GC pause, SIGSTOP, a slow downstream
past the TTL); a second holder takes the lock with a larger token and writes. When the
first wakes up, its write must not overwrite the newer one. Storing the token of the
last write on the row and updating only where the stored token is not larger makes
the database refuse it.

    fenced_update(Profile.objects.filter(user_id=123), token=fence, data=rebuilt)
"""

from __future__ import annotations

from typing import Any

from django.db.models import Q, QuerySet

from celery_explicit.errors import StaleFencingToken


def fenced_update(
    queryset: QuerySet[Any], *, token: int, field: str = "fencing_token", **values: Any
) -> int:
    """Update the rows whose ``field`` is NULL or <= ``token``; store ``token`` there.

    Returns the number of rows updated. Raises ``StaleFencingToken`` when rows match the
    queryset but each already carries a larger token: a newer holder wrote first. The
    same holder may write again with its own token.
    """
    fresh = Q(**{f"{field}__isnull": True}) | Q(**{f"{field}__lte": token})
    updated = queryset.filter(fresh).update(**{field: token}, **values)
    if updated == 0:
        newest = queryset.order_by(f"-{field}").values_list(field, flat=True).first()
        if newest is not None:
            raise StaleFencingToken(
                str(queryset.model._meta.label), token=token, current=int(newest)
            )
    return int(updated)
