"""``CorrelationMiddleware``: a web request's id becomes the correlation id of the jobs
it causes (``celery_explicit.correlation``).

Add ``"django_outbox.middleware.CorrelationMiddleware"`` to ``MIDDLEWARE``. The id is
read from the request header named by ``EXPLICIT_CORRELATION_HEADER`` (default
``X-Request-ID``, as set by most proxies and load balancers), or made fresh; every job
the view publishes (directly, on commit, through the outbox) carries it, and the
response echoes it in the same header so a client can quote it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

from celery_explicit import correlation, job_log
from celery_explicit.conf import settings

logger = job_log.get_logger("django_outbox.middleware")

#: What an incoming id may hold: printable ASCII without spaces, up to 255 characters
#: (the attempt row's column). Anything else is replaced by a fresh id, with a warning.
_VALID = re.compile(r"[\x21-\x7e]{1,255}")


class CorrelationMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        header = settings.correlation_header
        given = request.headers.get(header, "")
        if given and not _VALID.fullmatch(given):
            logger.warning(
                "request header %s is not a usable correlation id (%d characters; printable "
                "ASCII without spaces, at most 255): a new id is used instead",
                header,
                len(given),
            )
            given = ""
        with correlation.use(given) as correlation_id:
            response = self.get_response(request)
        response.headers.setdefault(header, correlation_id)
        return response
