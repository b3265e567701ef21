"""An idle relay's wake-up without a NOTIFY channel: it polls, and stop ends the wait."""

from __future__ import annotations

import threading
import time

from django_outbox.outbox.relay.loop import ListenWakeup, Relay, Wakeup


def test_without_a_channel_the_relay_polls() -> None:
    relay = Relay(notify_channel="", poll_interval=0.2)
    wakeup = relay.wakeup()
    assert type(wakeup) is Wakeup
    assert not isinstance(wakeup, ListenWakeup)
    assert wakeup.kind == "polling"
    started = time.monotonic()
    wakeup.wait(0.2)
    assert time.monotonic() - started > 0.15  # it waited: no wake-up but the poll


def test_stop_ends_a_poll_wait_at_once() -> None:
    relay = Relay(notify_channel="", poll_interval=60)
    wakeup = relay.wakeup()
    threading.Timer(0.1, relay.stop).start()
    started = time.monotonic()
    wakeup.wait(60)
    assert time.monotonic() - started < 5
    assert relay.stopping
