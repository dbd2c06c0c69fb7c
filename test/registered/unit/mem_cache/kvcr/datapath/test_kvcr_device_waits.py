"""Side-thread waits on a stream or event: bounded, and fine-grained at first.

A restore's copy on a GPU lasts milliseconds; a wait that sleeps 1 ms between
polls adds up to 1 ms to it. ``device_streams`` polls at most 50 us apart for the
first 50 ms of a wait, then at 1 ms, and raises at its deadline. Here the
waitable is a stand-in whose ``query`` turns true after a set time (CUDA events
are not available on CPU), and ``time.sleep`` is recorded.
"""

from __future__ import annotations

import time

import pytest

from sglang.srt.mem_cache.storage.kvcr.device import device_streams
from sglang.srt.mem_cache.storage.kvcr.device.device_streams import (
    DeviceStallError,
    wait_event,
)

pytestmark = pytest.mark.kvcr


class _DoneAfter:
    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds
        self.synced_after_done = 0

    def query(self) -> bool:
        return time.monotonic() >= self.at

    def synchronize(self) -> None:
        self.synced_after_done += self.query()


@pytest.fixture
def pauses(monkeypatch):
    seen: list[tuple[float, float]] = []  # (since the wait began, pause)
    real_sleep = time.sleep
    start = time.monotonic()

    def sleep(s: float) -> None:
        seen.append((time.monotonic() - start, s))
        real_sleep(s)

    monkeypatch.setattr(device_streams.time, "sleep", sleep)
    return seen


def test_a_short_wait_polls_finely(pauses):
    event = _DoneAfter(0.007)
    wait_event(event, timeout_s=5)
    assert pauses, "the wait never slept"
    assert max(p for _, p in pauses) <= 50e-6
    # Synchronized once done (instant), so the CUDA sanitizer sees the sync.
    assert event.synced_after_done == 1


def test_a_long_wait_backs_off_after_its_first_50_ms(pauses):
    wait_event(_DoneAfter(0.12), timeout_s=5)
    early = [p for t, p in pauses if t < 0.04]
    late = [p for t, p in pauses if t > 0.06]
    assert early and max(early) <= 50e-6
    assert late and max(late) == pytest.approx(1e-3)


def test_a_wait_raises_at_its_deadline():
    t0 = time.monotonic()
    with pytest.raises(DeviceStallError):
        wait_event(_DoneAfter(60), timeout_s=0.1)
    assert time.monotonic() - t0 < 2
