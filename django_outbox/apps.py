from django.apps import AppConfig


class DjangoOutboxConfig(AppConfig):
    name = "django_outbox"
    verbose_name = "Explicit jobs: ledger, attempts, dead letters, outbox"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Registers the system checks (django_outbox.E0xx / W0xx; retention's E020/W020
        # live beside the prune they guard) and the worker-side signal receivers that
        # record messages the task code never sees.
        from celery_explicit import store as explicit_store
        from django_outbox import checks, retention  # noqa: F401
        from django_outbox.store import unreached  # noqa: F401
        from django_outbox.store.backend import DjangoStore

        # The job path records through this store: celery_explicit never imports us.
        explicit_store.register(DjangoStore())
