"""The Django app's side of ``celery_explicit.store``: where the job path's facts live.

Registered in ``DjangoOutboxConfig.ready``. Each method hands over to the module that
owns the table: the ledger (effects and fences), the audit trail (attempts), the dead
letters, and the receivers (messages that never reached a task).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from celery_explicit.outcomes import DeadLetterReason
from celery_explicit.store import Effect, Statement
from django_outbox import audit, dead_letters, ledger, receivers


class DjangoStore:
    def effect(
        self,
        *,
        key: str,
        fingerprint: str,
        task_name: str,
        task_id: str,
        using: str | None,
        before_commit: Callable[[Effect], list[Statement]] | None,
        fence: int | None,
    ) -> AbstractContextManager[Effect]:
        return ledger.effect(
            key=key,
            fingerprint=fingerprint,
            task_name=task_name,
            task_id=task_id,
            using=using,
            before_commit=before_commit,
            fence=fence,
        )

    def attempt_statement(self, fields: Mapping[str, Any], *, replace: bool) -> Statement:
        return audit.insert_statement(fields, replace=replace)

    def record_attempt(self, fields: Mapping[str, Any], *, replace: bool) -> None:
        audit.record_attempt(fields, replace=replace)

    def record_dead_letter(
        self,
        *,
        task_id: str | None,
        task_name: str,
        reason: DeadLetterReason,
        args: Any,
        kwargs: Any,
        idempotency_key: str,
        error_class: str,
        error_message: str,
        traceback: str,
        attempts: int,
        correlation_id: str,
        queue: str,
    ) -> None:
        dead_letters.record(
            task_id=task_id,
            task_name=task_name,
            reason=reason,
            args=args,
            kwargs=kwargs,
            idempotency_key=idempotency_key,
            error_class=error_class,
            error_message=error_message,
            traceback=traceback,
            attempts=attempts,
            correlation_id=correlation_id,
            queue=queue,
        )

    def record_takeover(self, task_id: str, key: str, fence: int, previous: str) -> None:
        ledger.record_takeover(task_id, key, fence, previous)

    def record_hard_timeout(
        self,
        *,
        task_id: str | None,
        task_name: str,
        message: Any,
        timeout: float,
        args: Any,
        kwargs: Any,
    ) -> None:
        receivers.record_hard_timeout(
            task_id=task_id,
            task_name=task_name,
            message=message,
            timeout=timeout,
            args=args,
            kwargs=kwargs,
        )

    def record_undecodable(
        self, *, task_id: str | None, task_name: str, message: Any, error: BaseException
    ) -> None:
        receivers.record_undecodable(
            task_id=task_id, task_name=task_name, message=message, error=error
        )
