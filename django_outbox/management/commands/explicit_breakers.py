"""``manage.py explicit_breakers``: each declared downstream's breaker and busy slots."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand
from django.utils.module_loading import autodiscover_modules

from celery_explicit import downstream as downstream_mod
from celery_explicit import redis_state
from celery_explicit.redis_scripts import server_time
from celery_explicit.task import ExplicitTask
from django_outbox.conf import settings


class Command(BaseCommand):
    help = (
        "List the downstreams declared by ExplicitTasks: breaker state, consecutive "
        "failures, seconds since it opened, slots in use of the concurrency limit."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        app = settings.celery_app()
        autodiscover_modules("tasks")
        app.finalize(auto=True)
        declared = {
            t.contract.downstream.name: t.contract.downstream
            for t in app.tasks.values()
            if isinstance(t, ExplicitTask) and t.contract.downstream is not None
        }
        if not declared:
            self.stdout.write("no downstream declared")
            return
        client = redis_state.client()  # EXPLICIT_REDIS_URL, Sentinel included
        now_ms = server_time(client) * 1000  # opened_ms is the server's clock
        self.stdout.write(
            f"{'downstream':<24} {'state':<10} {'failures':>8} {'open for':>9} {'slots':>9}"
        )
        for name in sorted(declared):
            d = declared[name]
            state = downstream_mod.state(d, redis_client=client)
            opened = state.get("opened_ms")
            open_for = (
                f"{(now_ms - int(opened)) / 1000:.1f}s"
                if opened and state["state"] != "closed"
                else "-"
            )
            used = downstream_mod.slots_in_use(d, redis_client=client)
            self.stdout.write(
                f"{name:<24} {state['state']:<10} {state.get('failures', '0'):>8} "
                f"{open_for:>9} {used:>4}/{d.concurrency:<4}"
            )
