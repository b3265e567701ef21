from django.apps import AppConfig


class DjangoOutboxConfig(AppConfig):
    name = "django_outbox"
    verbose_name = "Explicit jobs: effects, attempts, dead letters"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Registers the system checks (django_outbox.E00x / W00x) and the worker-side
        # signal receivers that record messages the task code never sees.
        from django_outbox import (
            checks,  # noqa: F401
            receivers,  # noqa: F401
        )
