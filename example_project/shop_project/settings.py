"""A small shop using celery-explicit.

Runs on SQLite and a private Redis when nothing else is configured (the demo), or on
PostgreSQL with ``SHOP_DATABASE=postgres``.
"""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
STATE_DIR = Path(os.environ.get("SHOP_STATE_DIR", BASE_DIR / ".demo"))
STATE_DIR.mkdir(exist_ok=True)

SECRET_KEY = "demo-only-not-secret"
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
TIME_ZONE = "UTC"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_outbox",
    "shop",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "shop_project.urls"
STATIC_URL = "static/"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

if os.environ.get("SHOP_DATABASE") == "postgres":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "HOST": os.environ.get("PGHOST", "127.0.0.1"),
            "USER": os.environ.get("PGUSER", "postgres"),
            "NAME": os.environ.get("PGDATABASE", "shop"),
        }
    }
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": STATE_DIR / "shop.sqlite3",
            # Worker processes write concurrently: take the write lock at BEGIN (so the
            # busy timeout applies instead of an immediate "database is locked"), in WAL mode.
            "OPTIONS": {
                "transaction_mode": "IMMEDIATE",
                "timeout": 20,
                "init_command": "PRAGMA journal_mode=WAL;",
            },
        }
    }

CELERY_BROKER_URL = os.environ.get("SHOP_REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY_TASK_IGNORE_RESULT = True
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_SERIALIZER = "json"
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Each ExplicitTask's visibility_timeout is the lease on its own message; the global one
# is only the backstop and must outlast the longest lease (django_outbox.E003). Expired
# leases are looked for every second (django_outbox.W002).
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": 3600,
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
    # A worker killed mid-sweep leaves kombu's sweep mutex behind: 30 s, not 300 s.
    "unacked_mutex_expire": 30,
}
CELERY_DB_REUSE_MAX = 1000
# Run by `celery beat -S celery_explicit.beat:PersistentScheduler`: each slot published
# once, however many beats run. Every two seconds for the demo (SHOP_BEAT_QUEUE is the
# demo's queue); a real shop would settle nightly (crontab(hour=2, minute=0)).
CELERY_BEAT_SCHEDULE = {
    "settle-payouts": {
        "task": "shop.settle_payouts",
        "schedule": 2.0,
        "options": {"queue": os.environ.get("SHOP_BEAT_QUEUE", "celery")},
    }
}

EXPLICIT_CELERY_APP = "shop_project.celery.app"
# django_outbox.cache.versioned runs on django-redis (the demo points it at its own Redis).
CACHES = {
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": os.environ.get("SHOP_REDIS_URL", "redis://127.0.0.1:6379/0"),
        "KEY_PREFIX": "shop",
    }
}
