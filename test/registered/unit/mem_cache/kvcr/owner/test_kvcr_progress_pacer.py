"""The idle pacing wrapped around kvcr's progress iteration (progress_pacer.py)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_patches as progress_pacer


def _loop_state(**kw):
    state = {
        "_in_flight_ops": {},
        "_completed_backlog": [],
        "_stop_requested": False,
        "_kvcr_pacer_active": 0.0,
    }
    return SimpleNamespace(**{**state, **kw})


@pytest.fixture
def paced(monkeypatch):
    monkeypatch.setattr(progress_pacer, "_idle_s", 30.0)  # far past any deadline here
    monkeypatch.setattr(progress_pacer, "_installed", True)
    results = {"did": False}
    return progress_pacer._paced(lambda self: results["did"]), results


def test_idle_iteration_waits_until_woken(paced):
    step, _ = paced
    state = _loop_state()
    out: list[bool] = []
    runner = threading.Thread(target=lambda: out.append(step(state)))
    runner.start()
    runner.join(0.2)
    assert runner.is_alive()  # idle: it waits instead of spinning every 1 ms
    progress_pacer.wake()
    runner.join(10)  # a deadline, far below the 30 s idle wait
    assert not runner.is_alive() and out == [True]


@pytest.mark.parametrize(
    "busy",
    [
        {"_in_flight_ops": {1: object()}},
        {"_completed_backlog": [object()]},
        {"_stop_requested": True},
        {"_active_transfers": {1: object()}},
        {"_kvcr_pacer_active": float("inf")},  # worked within the last 50 ms
    ],
)
def test_busy_loop_is_not_paced(paced, busy):
    step, _ = paced
    done = threading.Event()
    out: list[bool] = []

    def run():
        out.append(step(_loop_state(**busy)))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(10)
    assert out == [False]  # kvcr then sleeps its own 1 ms


def test_an_iteration_that_worked_returns_at_once_and_is_remembered(paced):
    step, results = paced
    results["did"] = True
    state = _loop_state()
    before = time.monotonic()
    assert step(state) is True
    assert state._kvcr_pacer_active >= before
