"""Real ``manage.py explicit_relay`` processes for the tests, and the negative controls.

Run as a module (``python -m tests.support.relays no-skip-locked``) it starts one of the
negative-control relays: the production relay with one safeguard of its claim taken
out, to show that the tests of that safeguard can fail (or, ``slow-mark``, the
production relay with a pause where a kill must be survived).
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.support.processes import ManagedProcess, project_env


class RelayProcess(ManagedProcess):
    """One relay process, logging to a file; ``control`` picks a negative control.

    Ready when its log says ``outbox relay ready``; ``stop()`` returns its exit code.
    """

    kind = "relay"
    ready_marker = "outbox relay ready"
    ready_interval = 0.05

    def __init__(
        self,
        *,
        db_name: str,
        log_dir: Path,
        queue: str,
        args: tuple[str, ...] = (),
        broker_url: str | None = None,
        control: str | None = None,
        name: str | None = None,
    ) -> None:
        name = name or f"relay-{uuid.uuid4().hex[:6]}"
        extra = {"EXPLICIT_TEST_BROKER_URL": broker_url} if broker_url else None
        command = (
            [sys.executable, "-m", __name__, control]
            if control
            else [sys.executable, "-m", "django", "explicit_relay"]
        )
        super().__init__(
            [*command, *args],
            name=name,
            log_dir=log_dir,
            env=project_env(db_name=db_name, queue=queue, extra=extra),
        )


StartRelay = Callable[..., RelayProcess]
"""``start(*explicit_relay options, broker_url=None, control=None, ready=True)``."""


def relay_starter(queue: str, tmp_path: Path) -> Iterator[StartRelay]:
    """Body of a test module's ``start_relay`` fixture (it depends on ``transactional_db``,
    so the relays see committed rows and stop before the tables are flushed): start
    relay processes publishing to this test's queue; all are stopped afterwards."""
    from django.db import connection

    started: list[RelayProcess] = []

    def start(
        *args: str, broker_url: str | None = None, control: str | None = None, ready: bool = True
    ) -> RelayProcess:
        relay = RelayProcess(
            db_name=connection.settings_dict["NAME"],
            log_dir=tmp_path,
            queue=queue,
            args=args,
            broker_url=broker_url,
            control=control,
        )
        started.append(relay)
        return relay.wait_ready() if ready else relay

    yield start
    for relay in started:
        relay.stop()


# --- negative controls, run as ``python -m tests.support.relays NAME [options]`` ------------


def main() -> None:
    import django

    django.setup()
    from django_outbox.outbox.relay.claim import CLAIM_POSTGRESQL, run_claim
    from django_outbox.outbox.relay.loop import Relay

    def without(pattern: str) -> str:
        """The production claim with one clause taken out; it must be there to take."""
        sql, found = re.subn(pattern, "", CLAIM_POSTGRESQL, flags=re.DOTALL)
        assert found == 1, f"{pattern!r} is not in the claim: the control would change nothing"
        return sql

    class NoSkipLockedRelay(Relay):
        """A plain SELECT: two relays read the same rows and both publish them."""

        sql = without(r"FOR UPDATE OF event SKIP LOCKED")

        def claim(self) -> list[Any]:
            return run_claim(self.using, self.sql, self.batch_size)

    class OrderBlindRelay(Relay):
        """SKIP LOCKED without the head-of-key test: relays publish one key in parallel.

        Every other claim of a relay is held 50 ms, far longer than a relay's cycle, so
        another relay publishes the batch after it first: the overtaking happens every
        run, not only when the scheduler allows it."""

        sql = without(
            r"AND \(event\.ordering_key = '' OR event\.id IN \(.*?GROUP BY oldest\.ordering_key\)\)"
        )
        claims = 0

        def claim(self) -> list[Any]:
            claimed = run_claim(self.using, self.sql, self.batch_size)
            self.claims += 1
            if claimed and self.claims % 2:
                time.sleep(0.05)
            return claimed

    class SlowMarkRelay(Relay):
        """The production relay, pausing between the send and the mark (``flushed`` in
        its log): a kill there lands in that window every time, not by luck."""

        def _mark(self, marks: dict[Any, list[Any]], *, commit: bool) -> None:
            if published := marks.get("published"):
                print(f"flushed {len(published)}", flush=True)
                time.sleep(5)
            super()._mark(marks, commit=commit)

    class MarksUnsentRelay(Relay):
        """Marks events published without sending them: the loss the kill tests look for."""

        def _publish(self, event: Any, producer: Any) -> Any:
            from django_outbox.models import OutboxStatus

            return OutboxStatus.PUBLISHED

    controls = {
        "no-skip-locked": NoSkipLockedRelay,
        "order-blind": OrderBlindRelay,
        "slow-mark": SlowMarkRelay,
        "marks-unsent": MarksUnsentRelay,
    }
    parser = argparse.ArgumentParser()
    parser.add_argument("control", choices=sorted(controls))
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--poll-interval", type=float, default=None)
    options = parser.parse_args()
    relay = controls[options.control](
        batch_size=options.batch_size, poll_interval=options.poll_interval
    )
    signal.signal(signal.SIGTERM, lambda *_: relay.stop())
    relay.run(
        on_ready=lambda wakeup: print(
            f"outbox relay ready (negative control {options.control})", flush=True
        )
    )


if __name__ == "__main__":
    main()
