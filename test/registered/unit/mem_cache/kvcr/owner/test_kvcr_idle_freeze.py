"""The idle freeze (``owner/idle_freeze.py``): on a quiet idle pass, once enough
pages came, garbage is collected and the survivors frozen, so Python's full
collections stop walking KVCR's per-page objects.

Over a real kvcr + NIXL on CPU tensors: nothing is frozen before the page
count is reached, while a preparation is alive, while a deposit is in flight
or while SGLang holds a session's requests; garbage cycles made before the
freeze are collected, never frozen; an evicted page's objects leave the frozen
heap (kvcr's page objects hold no cycles, so reference counting still frees
them); close gives every frozen object back to the collector.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from cpu_harness import kvcr_stack
from cpu_harness.kvcr_pages import (
    fill_random,
    hashes_for,
    kv_transfer,
    make_linker,
    make_pool,
    offload_and_commit,
    wait_until,
)
from sglang.srt.mem_cache.storage.kvcr.datapath.dram_copy import DramCopier
from sglang.srt.mem_cache.storage.kvcr.observability.linker_stats import LinkerStats
from sglang.srt.mem_cache.storage.kvcr.owner.idle_freeze import IdleFreezer
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
)

pytestmark = pytest.mark.kvcr


class _Cycle:
    """A garbage cycle's member (weak-referenceable)."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def thawed():
    """Start and end with nothing frozen (this process's other tests freeze none)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def _garbage_cycle() -> weakref.ref:
    return weakref.ref(_Cycle())


def test_freezer_collects_then_freezes_only_when_due(thawed):
    stats = LinkerStats()
    freezer = IdleFreezer(100, stats)
    assert not freezer.maybe_freeze(99)
    assert gc.get_freeze_count() == 0 and stats.gc_freezes == 0
    gc.disable()  # no automatic collection between the cycle and the freeze
    try:
        dead, live = _garbage_cycle(), _Cycle()
        assert dead() is not None  # not collected yet: only a collection frees it
        assert freezer.maybe_freeze(100)
    finally:
        gc.enable()
    assert dead() is None  # collected before the freeze, not frozen with it
    assert gc.get_freeze_count() > 0  # ``live`` among the survivors frozen
    assert stats.gc_freezes == 1 and stats.gc_collected >= 1
    assert not freezer.due(199) and freezer.due(200)
    freezer.thaw()
    assert gc.get_freeze_count() == 0
    assert freezer.due(200) and freezer.due(0)  # a thaw makes the next pass freeze
    assert live.me is live


def test_freezer_off_never_freezes(thawed):
    freezer = IdleFreezer(0, LinkerStats())
    assert not freezer.due(10**9) and not freezer.maybe_freeze(10**9)
    freezer.thaw()  # nothing frozen: SGLang's own freeze would be left alone
    assert gc.get_freeze_count() == 0


def _idle_until_frozen(lk, freezes: int) -> None:
    def frozen() -> bool:
        lk.scheduler_idle()
        return lk.stats.gc_freezes >= freezes

    wait_until(frozen, what=f"{freezes} idle freeze(s)")


def test_idle_pass_freezes_when_quiet_and_flush_and_close_thaw(thawed):
    pool = make_pool()
    fill_random(pool, range(1, 9), seed=3)
    lk = make_linker(pool, gc_freeze_pages=8)
    try:
        first = hashes_for(4, "freeze-a")
        assert offload_and_commit(lk, first, [1, 2, 3, 4]) is True
        lk.scheduler_idle()
        assert lk.stats.gc_freezes == 0  # 4 pages of 8
        assert offload_and_commit(lk, hashes_for(4, "freeze-b"), [5, 6, 7, 8])
        handle = lk.prepare_request(LinkerRequestContext("held"), kv_transfer(first))
        for _ in range(20):  # due, but a preparation is alive
            lk.scheduler_idle()
        assert lk.stats.gc_freezes == 0 and gc.get_freeze_count() == 0
        wait_until(lambda: lk.preparation_ready(handle), what="preparation")
        lk.release_request("held")
        wait_until(
            lambda: (
                lk.scheduler_idle(holds_sessions=lambda: True),
                lk.preparations.quiet,
            )[1],
            what="quiet",
        )
        for _ in range(5):  # quiet, but SGLang holds a session's requests
            lk.scheduler_idle(holds_sessions=lambda: True)
        assert lk.stats.gc_freezes == 0 and gc.get_freeze_count() == 0
        dead = _garbage_cycle()
        _idle_until_frozen(lk, 1)
        assert dead() is None
        assert gc.get_freeze_count() > 0
        assert "gc_freezes=1 " in lk.stats_line()
        lk.reset()  # a flush: the old core's objects are collectable again
        assert gc.get_freeze_count() == 0
        assert offload_and_commit(lk, hashes_for(1, "freeze-c"), [1]) is True
        _idle_until_frozen(lk, 2)  # due again at once after the thaw
        assert gc.get_freeze_count() > 0
    finally:
        lk.close()
    assert gc.get_freeze_count() == 0  # close gave them back


def test_no_freeze_while_a_deposit_is_in_flight(thawed, monkeypatch):
    """A deposit whose copy has not landed holds the freeze off; its result
    coming back lets the next idle pass freeze."""
    release, started = threading.Event(), threading.Event()
    issue = DramCopier._issue

    def held(self, job, stream):
        started.set()
        assert release.wait(10), "test never released the copy"
        return issue(self, job, stream)

    monkeypatch.setattr(DramCopier, "_issue", held)
    pool = make_pool()
    fill_random(pool, range(1, 5), seed=5)
    lk = make_linker(pool, gc_freeze_pages=4, idle_offload_delay_us=0)
    try:
        assert lk.offload(kv_transfer(hashes_for(4, "in-flight"), [1, 2, 3, 4]))
        wait_until(lambda: (lk.scheduler_idle(), started.is_set())[1], what="copy")
        for _ in range(20):
            lk.scheduler_idle()
        assert lk.stats.gc_freezes == 0 and gc.get_freeze_count() == 0
        release.set()
        _idle_until_frozen(lk, 1)
    finally:
        release.set()
        lk.close()


def test_a_kvcr_restart_thaws(thawed):
    """A KVCR that failed and restarts gives the frozen heap back (the dead
    core's objects may hold cycles); the next quiet idle pass freezes again."""
    pool = make_pool()
    fill_random(pool, range(1, 3), seed=6)
    lk = make_linker(pool, gc_freeze_pages=2)
    try:
        assert offload_and_commit(lk, hashes_for(2, "restart"), [1, 2]) is True
        _idle_until_frozen(lk, 1)
        assert gc.get_freeze_count() > 0
        stalled = kvcr_stack.kvcr_stall_error(timeout_ms=5000, gap_s=5.0)
        lk._adapter.call(lambda kv: kv._core._resilience_errors.append(stalled))
        wait_until(
            lambda: (lk.lookup("x", kv_transfer([])), lk.kvcr_down)[1],
            what="linker down",
        )
        lk.recovery.next_attempt = 0.0  # the restart is due now
        wait_until(
            lambda: (lk.num_completed_offloads(), not lk.kvcr_down)[1],
            what="KVCR restarted",
        )
        assert gc.get_freeze_count() == 0
        _idle_until_frozen(lk, 2)  # due at once after the thaw
    finally:
        lk.close()


def test_evicted_pages_leave_the_frozen_heap(thawed):
    """Fill KVCR DRAM (64 pages), freeze, then offload 64 new pages: every
    frozen page is evicted, and its objects are freed while frozen."""
    pool = make_pool()
    fill_random(pool, range(1, 17), seed=4)
    lk = make_linker(pool, gc_freeze_pages=64)
    try:
        for batch in range(4):
            hashes = hashes_for(16, f"old-{batch}")
            assert offload_and_commit(lk, hashes, list(range(1, 17))) is True
        _idle_until_frozen(lk, 1)
        frozen = gc.get_freeze_count()
        evicted = lk.stats_snapshot()["evicted_pages"]
        for batch in range(4):
            hashes = hashes_for(16, f"new-{batch}")
            assert offload_and_commit(lk, hashes, list(range(1, 17))) is True
        wait_until(
            lambda: lk.stats_snapshot()["evicted_pages"] >= evicted + 64,
            what="every frozen page evicted",
        )
        freed = frozen - gc.get_freeze_count()
        assert freed >= 3 * 64, f"only {freed} frozen objects freed for 64 pages"
    finally:
        lk.close()
