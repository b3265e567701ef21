"""``python -m celery_explicit --version``: what a bug report needs in one paste.

The package's version (``celery_explicit.versions``), the Celery, kombu, Django and
redis-py this interpreter imports (with the tested ranges, and whether a worker would
refuse them), and whether the configured Redis has functions (Redis 7+: our Lua runs as
``FCALL``; otherwise as ``EVALSHA`` scripts, see ``celery_explicit.redis_scripts``).

The configured Redis is ``EXPLICIT_REDIS_URL`` (or the broker) when
``DJANGO_SETTINGS_MODULE`` names the project's settings, else ``--redis-url``, else
``redis://127.0.0.1:6379/0``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from celery_explicit import versions


def _configured_redis_url() -> tuple[str, str]:
    """The Redis URL the project's settings name, and where it came from."""
    import django
    from django.core.exceptions import ImproperlyConfigured

    default = "redis://127.0.0.1:6379/0"
    try:
        django.setup()  # reads DJANGO_SETTINGS_MODULE; raises without it
    except ImproperlyConfigured:
        return default, "the default: no DJANGO_SETTINGS_MODULE"
    except ImportError as exc:
        return default, f"the default: the Django settings do not import: {exc}"
    from celery_explicit.conf import settings

    if settings.redis_url_setting:
        return settings.redis_url_setting, "EXPLICIT_REDIS_URL"
    try:
        return settings.redis_url, "the Celery broker"
    except ImportError as exc:
        return default, f"the default: EXPLICIT_CELERY_APP does not import: {exc}"


def redis_functions(url: str) -> str:
    """One line: the server's version and whether it has functions, or why not known.

    ``FUNCTION LIST`` with a library name no one has is read-only: it answers an empty
    list on Redis 7+, "unknown command" on Redis 6, and a permission error to a user
    whose ACL lacks ``FUNCTION`` (our Lua then runs as scripts too)."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
    try:
        server = str(client.info("server").get("redis_version", "?"))
        try:
            client.execute_command(  # type: ignore[no-untyped-call]
                "FUNCTION", "LIST", "LIBRARYNAME", "celery_explicit-probe"
            )
        except redis.exceptions.NoPermissionError:
            return f"Redis {server}: functions not permitted for this user (Lua runs as scripts)"
        except redis.exceptions.ResponseError:
            return f"Redis {server}: no functions (Lua runs as EVALSHA scripts)"
        return f"Redis {server}: functions available (Lua runs as FCALL)"
    except redis.exceptions.RedisError as exc:
        return f"Redis not reachable ({type(exc).__name__}: {exc})"
    finally:
        client.close()


def report(*, redis_url: str | None = None) -> list[str]:
    """The lines ``--version`` prints."""
    import django
    import redis

    have = versions.installed()
    outside = versions.untested(have)
    lines = [f"celery-explicit {versions.__version__}", f"Python {sys.version.split()[0]}"]
    for name, label in (("celery", "Celery"), ("kombu", "kombu")):
        tested = versions.TESTED[name]
        verdict = (
            f"UNTESTED, outside {tested}: a worker refuses it"
            if name in outside
            else f"in the tested range {tested}"
        )
        lines.append(f"{label} {have[name]} ({verdict})")
    lines.append(f"Django {django.get_version()}")
    lines.append(f"redis-py {redis.__version__}")
    url, origin = (redis_url, "--redis-url") if redis_url else _configured_redis_url()
    lines.append(f"Redis at {_without_password(url)} ({origin}): {redis_functions(url)}")
    return lines


def _without_password(url: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (
        f":{parts.port}" if parts.port else ""
    )
    return urlunsplit(parts._replace(netloc=netloc))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m celery_explicit",
        description="celery-explicit: the versions in use and what the configured Redis has.",
    )
    parser.add_argument(
        "--version", action="store_true", help="show the versions and the Redis verdict"
    )
    parser.add_argument("--redis-url", help="the Redis to look at (default: the settings')")
    args = parser.parse_args(argv)
    if not args.version:
        parser.print_help()
        return 2
    print("\n".join(report(redis_url=args.redis_url)))
    # A worker would refuse these versions: say so in the exit status too (scripts).
    return 1 if versions.untested(versions.installed()) else 0


if __name__ == "__main__":
    sys.exit(main())
