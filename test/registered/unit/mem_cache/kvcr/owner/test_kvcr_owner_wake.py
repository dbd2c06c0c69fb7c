"""The owner thread sleeps while idle and kvcr's progress loop wakes it when it
hands it work (kvcr_patches/owner_wake.py), over a real kvcr 0.1.1 + NIXL.

``QUIET_POLL_S`` (1 s) is the owner's idle safety poll: an owner that answers
within a fraction of it was woken, not timed out.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from cpu_harness.kvcr_pages import make_linker, make_pool
from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_executor, kvcr_patches
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_executor import (
    IDLE_POLL_S,
    QUIET_POLL_S,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import owner_wake

IDLE_S = 0.6  # twelve of the old 50 ms idle polls


def _count_polls(linker) -> tuple[list[float], object]:
    """Record when the owner thread polls KVCR; kvcr's progress loop."""
    polls: list[float] = []

    def install(kv):
        original = kv.poll_completed

        def counting():
            polls.append(time.monotonic())
            return original()

        kv.poll_completed = counting
        return kv._core._progress

    return polls, linker.session.adapter.call(install)


def test_an_idle_owner_does_not_poll_every_50_ms():
    assert QUIET_POLL_S >= 10 * IDLE_POLL_S
    linker = make_linker(make_pool())
    try:
        polls, _ = _count_polls(linker)
        time.sleep(0.1)  # the call's own poll, and start-up's last items
        start = time.monotonic()
        time.sleep(IDLE_S)
        assert len([t for t in polls if t >= start]) <= 1
    finally:
        linker.close()


def test_the_progress_loop_wakes_an_idle_owner_when_it_hands_it_work(monkeypatch):
    """With a 30 s safety poll, an owner that polls within 1 s was woken."""
    monkeypatch.setattr(kvcr_executor, "QUIET_POLL_S", 30.0)
    linker = make_linker(make_pool())
    try:
        polls, loop = _count_polls(linker)
        time.sleep(0.2)
        # kvcr's loop publishes a progress update to the owner thread (as when a
        # peer connects): the owner polls at once, each time.
        for _ in range(3):
            woken_after = time.monotonic()
            loop._poll.__self__._published_remote_count = -1
            kvcr_patches.wake()  # the progress loop iterates now
            deadline = woken_after + 1.0
            while time.monotonic() < deadline and not any(
                t > woken_after for t in polls
            ):
                time.sleep(0.005)
            assert any(woken_after < t < deadline for t in polls)
            time.sleep(0.05)
    finally:
        linker.close()


def test_items_left_after_one_poll_are_polled_again_at_once():
    """``take_completed`` reads a batch at a time: what is left is not left for
    the safety poll. (Put and taken back on the owner thread, so no poll of
    its own sees the stand-in item.)"""
    linker = make_linker(make_pool())
    try:
        executor = linker.session.adapter._executor

        def periods(kv):
            before = executor.poll_period()
            kv._core._progress._completed.put(object())  # published, not taken
            try:
                return before, owner_wake.completed_waiting(kv), executor.poll_period()
            finally:
                kv._core._progress._completed.get_nowait()

        assert linker.session.adapter.call(periods) == (QUIET_POLL_S, True, 0.0)
    finally:
        linker.close()


def test_publishes_before_the_owner_polls_queue_one_wake():
    wakes: list[int] = []
    wake = owner_wake.CoalescedWake(lambda: wakes.append(1))
    for _ in range(3):
        wake()
    assert wakes == [1]
    wake.polled()  # what the owner's poll() does first
    wake()
    assert wakes == [1, 1]


def _publishing_loop(count: int, failure: BaseException | None = None):
    calls: list[int] = []
    loop = SimpleNamespace(_failure=failure, _completed=None)

    def publish(self, limit):
        calls.append(limit)
        return count

    return loop, owner_wake._publishing(publish), calls


def test_only_a_publishing_or_failed_loop_wakes_the_owner():
    woken = threading.Event()
    for count, failure, wakes in (
        (0, None, False),
        (2, None, True),
        (0, OSError(), True),
    ):
        loop, publish, calls = _publishing_loop(count, failure)
        loop._kvcr_on_publish = woken.set
        woken.clear()
        assert publish(loop, 8) == count and calls == [8]
        assert woken.is_set() is wakes


def test_a_failed_loop_wakes_the_owner_before_its_cleanup():
    order: list[str] = []
    for failure, expected in ((None, ["cleanup"]), (OSError(), ["wake", "cleanup"])):
        order.clear()
        loop = SimpleNamespace(
            _failure=failure, _kvcr_on_publish=lambda: order.append("wake")
        )
        owner_wake._closing(lambda self: order.append("cleanup"))(loop)
        assert order == expected


def test_a_failing_wake_never_fails_the_loop():
    loop, publish, _ = _publishing_loop(1)

    def broken():
        raise RuntimeError("inbox gone")

    loop._kvcr_on_publish = broken
    assert publish(loop, 4) == 1


def test_a_stand_in_kvcr_keeps_the_idle_poll():
    """No kvcr progress loop to hook (a test's stand-in KVCR): the owner keeps
    its 50 ms idle poll, nothing wakes it otherwise."""
    assert owner_wake.on_published(SimpleNamespace(), lambda: None) is False
    stand_in = SimpleNamespace(_core=SimpleNamespace(_progress=SimpleNamespace()))
    assert owner_wake.on_published(stand_in, lambda: None) is False
    assert owner_wake.completed_waiting(SimpleNamespace()) is False
