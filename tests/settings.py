"""Settings for the test suite: real PostgreSQL and Redis, configurable by environment.

Worker processes started by the tests import these settings too, with
``EXPLICIT_TEST_DB_NAME`` pointing them at pytest-django's test database.
"""

import importlib.util
import os

SECRET_KEY = "tests-only"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.admin",
    "django.contrib.staticfiles",  # the browser tests' live server serves the admin's CSS
    "django_outbox",
    "tests.testapp",
    # Two beats on one database (tests/fault/test_periodic.py), where it is installed:
    # the dev extra has it; the matrix's Django 6.1 sessions cannot (it declares
    # Django<6.1) and run no fault tests.
    *(["django_celery_beat"] if importlib.util.find_spec("django_celery_beat") else []),
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.urls"
STATIC_URL = "/static/"
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

_db_name = os.environ.get("EXPLICIT_TEST_DB_NAME")
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": os.environ.get("PGHOST", "127.0.0.1"),
        "PORT": os.environ.get("PGPORT", "5432"),
        "USER": os.environ.get("PGUSER", "postgres"),
        "NAME": _db_name or os.environ.get("PGDATABASE", "explicit"),
        # Separate names let two test sessions share one server (EXPLICIT_TEST_DATABASE).
        "TEST": {"NAME": os.environ.get("EXPLICIT_TEST_DATABASE", "test_explicit")},
    }
}

REDIS_URL = os.environ.get("EXPLICIT_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")

CELERY_BROKER_URL = os.environ.get("EXPLICIT_TEST_BROKER_URL", REDIS_URL)
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_SERIALIZER = "json"
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# The global visibility timeout is only the backstop (>= every task's lease: E003);
# each ExplicitTask's own lease governs its message, checked by a sweep every second.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    # EXPLICIT_TEST_BACKSTOP: a test that needs a broker backstop shorter than a task's
    # lease (the start-up refusal) sets it for its worker.
    "visibility_timeout": int(os.environ.get("EXPLICIT_TEST_BACKSTOP", "60")),
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
    # kombu holds a mutex (default 300 s) while one worker sweeps: a worker SIGKILLed
    # mid-sweep (the fault tests kill workers) would stop every restore for 5 minutes.
    "unacked_mutex_expire": 5,
}
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# EXPLICIT_TEST_QUEUE_TYPE=quorum: RabbitMQ quorum queues, as a RabbitMQ cluster runs
# them (Celery declares its queues so, counts and delays natively); with publisher
# confirms, the transport option a quorum queue's durability is worth only with.
if os.environ.get("EXPLICIT_TEST_QUEUE_TYPE") == "quorum":
    CELERY_TASK_DEFAULT_QUEUE_TYPE = "quorum"
    CELERY_BROKER_TRANSPORT_OPTIONS["confirm_publish"] = True
# EXPLICIT_TEST_CONFIRM_PUBLISH=1 or 0: publisher confirms on or off whatever the queue
# type (tests/integration/test_publisher_confirms.py and its negative control).
if (_confirms := os.environ.get("EXPLICIT_TEST_CONFIRM_PUBLISH")) is not None:
    CELERY_BROKER_TRANSPORT_OPTIONS["confirm_publish"] = _confirms == "1"

# The log tests (tests/integration/test_job_logs.py) start workers logging as a user's
# would: "celery" is Celery's own set-up (`celery worker -l INFO`, its default format);
# "json" is the LOGGING snippet of docs/reference.md (python-json-logger).
_LOG_STYLE = os.environ.get("EXPLICIT_TEST_LOG_STYLE", "")
if _LOG_STYLE == "celery":
    CELERY_WORKER_HIJACK_ROOT_LOGGER = True
elif _LOG_STYLE == "json":
    LOGGING = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "json": {
                "()": "pythonjsonlogger.json.JsonFormatter",
                "fmt": "%(asctime)s %(levelname)s %(name)s %(process)d %(message)s",
            }
        },
        "handlers": {"stdout": {"class": "logging.StreamHandler", "formatter": "json"}},
        "root": {"handlers": ["stdout"], "level": "INFO"},
    }

EXPLICIT_CELERY_APP = "tests.celery_app.app"

# django.tasks (Django 6.1+; Django 5.2 never reads it): tests/testapp/django_tasks.py
# runs on celery-explicit's backend. No QUEUES: each test sends to a queue of its own.
TASKS = {"default": {"BACKEND": "django_outbox.tasks_backend.ExplicitBackend", "QUEUES": []}}

# EXPLICIT_TEST_STATE_URL: the state store elsewhere than the broker (a private
# Redis Cluster, a Sentinel group).
EXPLICIT_REDIS_URL = os.environ.get("EXPLICIT_TEST_STATE_URL", REDIS_URL)

# django_outbox.cache.versioned runs on django-redis; tests give each test its own KEY_PREFIX.
CACHES = {
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": os.environ.get("EXPLICIT_TEST_CACHE_URL", "redis://127.0.0.1:6379/14"),
    }
}

# The start-up refusal's escape hatch, for the test that shows it (tests/integration/
# test_startup_checks.py); off everywhere else.
EXPLICIT_START_DESPITE_CHECK_ERRORS = os.environ.get("EXPLICIT_TEST_START_ANYWAY") == "1"

# The trace tests (tests/integration/test_tracing.py) give the worker and relay processes
# they start an OpenTelemetry SDK provider writing spans to a file; unset, tracing is off.
if os.environ.get("EXPLICIT_TEST_TRACE_FILE"):
    from tests.support.tracing import install_from_env

    install_from_env()
