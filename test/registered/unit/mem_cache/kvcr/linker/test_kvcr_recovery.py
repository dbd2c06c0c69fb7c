"""A KVCR fault degrades the linker, it never kills serving (issue 24, finding 1).

Real kvcr 0.1.1 over CPU: the fault is injected on the real owner thread (the
KVCR's ``poll_completed`` raises, as a dead progress thread's failure surfaces
there) or delivered through kvcr's own resilience path. Every hook keeps
answering, lookups miss, offloads fail, and after the backoff a new KVCR serves
pages byte-exact again.
"""

from __future__ import annotations

import pytest
import torch

from cpu_harness import kvcr_stack
from cpu_harness.kvcr_pages import fill_random as fill_pages
from cpu_harness.kvcr_pages import (
    hashes_for,
    kv_transfer,
    make_linker,
    offload_and_commit,
    owner_stalled,
    page_bytes,
    prepare,
    restore,
    wait_until,
)
from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRTimeoutError
from sglang.srt.mem_cache.storage.kvcr.datapath.offload_queue import OffloadQueue
from sglang.srt.mem_cache.storage.kvcr.owner import recovery
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import (
    EntryResult,
    EntryStatus,
    OpDone,
    OpId,
    OpKind,
)
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
)

pytestmark = pytest.mark.kvcr


STALLED = kvcr_stack.kvcr_stall_error(timeout_ms=5000, gap_s=5.0)


def _kvcr(linker):
    """The running KVCR object (the owner thread's)."""
    return linker._adapter._executor.kvcr


def _round_trip(linker, pool, salt: str, page: int, dest: int) -> None:
    """A page offloaded now comes back byte-exact into another slot."""
    fill_pages(pool, [page], seed=hash(salt) % 1000)
    hashes = hashes_for(1, salt)
    original = page_bytes(pool, page).clone()
    assert offload_and_commit(linker, hashes, [page]) is True
    prepare(linker, f"rt-{salt}", hashes)
    assert restore(linker, f"rt-{salt}", hashes, [dest]) is True
    assert torch.equal(page_bytes(pool, dest), original)


def _until_up(linker, timeout: float = 10.0) -> None:
    """Step the linker as SGLang does (its once-a-step offload poll, the only
    pump that may restart) until it restarted its KVCR."""
    wait_until(
        lambda: (linker.num_completed_offloads(), not linker.kvcr_down)[1],
        timeout=timeout,
        what="KVCR restarted",
    )


def test_no_restart_from_a_lookup_or_a_preparation(linker):
    """Between a request's lookup and its load a restart would drop the claims
    the load needs: only the once-a-step pump restarts."""
    linker._adapter.call(lambda kv: kv._core._resilience_errors.append(STALLED))
    wait_until(
        lambda: (linker.lookup("x", kv_transfer([])), linker.kvcr_down)[1],
        what="linker down",
    )
    linker.recovery.next_attempt = 0.0  # due now
    for _ in range(3):
        linker.lookup("x", kv_transfer([]))
        handle = linker.prepare_request(LinkerRequestContext("p"), kv_transfer([]))
        assert linker.preparation_ready(handle)
    assert linker.kvcr_down
    _until_up(linker)
    assert linker.stats_snapshot()["kvcr_restarts"] == 1


def test_an_owner_thread_fault_degrades_then_a_restart_serves_again(
    pool, linker, monkeypatch
):
    """The owner thread dies with a deposit in flight: no hook raises, the
    offload completes failed, lookups miss (even a prepared one), new offloads
    fail at once; after the backoff a new KVCR (new agent) runs, the pages the
    old one held are reported removed, and a new page round-trips byte-exact."""
    fill_pages(pool, [1, 2], seed=31)
    held = hashes_for(2, "held")
    assert offload_and_commit(linker, held, [1, 2]) is True
    prepare(linker, "before", held)  # claims on the old KVCR
    agent = linker.session.agent

    def broken_poll():
        raise RuntimeError("injected: KVCR progress thread died")

    with owner_stalled(linker):
        fill_pages(pool, [3], seed=32)
        assert linker.offload(kv_transfer(hashes_for(1, "lost"), [3])) is True
        monkeypatch.setattr(_kvcr(linker), "poll_completed", broken_poll)
    wait_until(lambda: linker.num_completed_offloads() >= 1, what="failed offload")
    assert linker.pop_completed_offload() is False
    assert linker.kvcr_down
    snap = linker.stats_snapshot()
    assert (snap["kvcr_failures"], snap["kvcr_restarts"], snap["kvcr_down"]) == (
        1,
        0,
        1,
    )

    # Down: every hook answers, nothing reaches KVCR, every request recomputes.
    assert linker.lookup("before", kv_transfer(held)) == []
    handle = linker.prepare_request(LinkerRequestContext("new"), kv_transfer(held))
    assert linker.preparation_ready(handle) is True
    assert linker.lookup("new", kv_transfer(held)) == []
    assert linker.stats.miss_kvcr_down == 2
    assert linker.offload(kv_transfer(hashes_for(1, "down"), [3])) is True
    assert linker.num_completed_offloads() == 1
    assert linker.pop_completed_offload() is False
    linker.release_request("before")
    assert linker.claims_outstanding() == 0
    assert "kvcr_down=1" in linker.stats_line()

    _until_up(linker)
    assert linker.session.agent != agent
    snap = linker.stats_snapshot()
    assert (snap["kvcr_failures"], snap["kvcr_restarts"], snap["kvcr_down"]) == (
        1,
        1,
        0,
    )
    assert sorted(linker.take_removed_page_hashes()) == sorted(held)
    _round_trip(linker, pool, "after", page=4, dest=20)


def test_restart_waits_for_a_restore_that_reads_the_old_dram(pool, linker):
    """A request whose lookup hit before the fault still restores from the old
    DRAM; no restart happens while its load is queued (a new DRAM share would
    make its slots read other bytes), and the restart follows its finish."""
    fill_pages(pool, [1], seed=41)
    hashes = hashes_for(1, "hit")
    original = page_bytes(pool, 1).clone()
    assert offload_and_commit(linker, hashes, [1]) is True
    prepare(linker, "hit", hashes)  # the lookup hit
    with owner_stalled(linker):
        linker._adapter._executor.kvcr.poll_completed = _raise
    wait_until(lambda: (linker.lookup("x", kv_transfer([])), linker.kvcr_down)[1])
    linker.recovery.next_attempt = 0.0  # a restart is due from now on
    assert linker.load("hit", kv_transfer(hashes, [9])) is True
    storage = dict(linker.dram.storage)
    for _ in range(3):  # pumps while the load is queued: no restart
        assert linker.lookup("y", kv_transfer(hashes)) == []
    assert linker.kvcr_down
    assert all(linker.dram.storage[n] is t for n, t in storage.items())
    index = linker.start_layer_wise_loading()
    assert linker.finish_layer_wise_loading(index) is True
    assert torch.equal(page_bytes(pool, 9), original)
    linker.recovery.next_attempt = 0.0
    _until_up(linker)
    # The failed owner thread closed its KVCR cleanly: the share is idle, so it
    # is zeroed and reused (nothing quarantined, peer fetches stay on).
    assert all(linker.dram.storage[n] is t for n, t in storage.items())
    assert not any(t.any() for t in linker.dram.storage.values())
    gauges = linker.dram.gauges()
    assert gauges.quarantined_bytes == 0 and not gauges.peer_fetches_off


def _raise():
    raise RuntimeError("injected: KVCR progress thread died")


def test_a_flush_whose_old_close_times_out_completes_and_the_linker_works(pool, linker):
    """SGLang's flush never raises because the old KVCR's close timed out: its
    DRAM is quarantined and the next KVCR serves pages."""
    old = dict(linker.dram.storage)
    real_close = linker._adapter.close

    def stuck_close(timeout_s=None):
        real_close(timeout_s)
        raise KVCRTimeoutError("KVCR owner thread still alive after 30 s")

    linker._adapter.close = stuck_close
    linker.reset()
    assert linker.quarantined_bytes() == sum(t.numel() for t in old.values())
    assert not linker.kvcr_down
    _round_trip(linker, pool, "flushed", page=5, dest=21)


def test_a_flush_while_down_brings_kvcr_back(pool, linker):
    """A flush of a linker whose KVCR failed (its close raises) raises nothing
    and leaves a working KVCR."""
    with owner_stalled(linker):
        linker._adapter._executor.kvcr.poll_completed = _raise
    wait_until(lambda: (linker.lookup("x", kv_transfer([])), linker.kvcr_down)[1])
    linker.reset()
    assert not linker.kvcr_down
    assert linker.stats_snapshot()["kvcr_down"] == 0
    _round_trip(linker, pool, "after-flush", page=6, dest=22)


def test_closing_a_linker_whose_kvcr_is_down_raises_nothing(pool):
    """Shutdown while down: the failed KVCR's close raises inside, the linker's
    close does not (its DRAM is kept locked, not freed)."""
    lk = make_linker(pool)
    with owner_stalled(lk):
        lk._adapter._executor.kvcr.poll_completed = _raise
    wait_until(lambda: (lk.lookup("x", kv_transfer([])), lk.kvcr_down)[1])
    lk.close()
    assert lk.is_quiescent()


def test_source_writes_off_until_restart_leads_to_a_restart(pool, linker):
    """kvcr's "new source writes disabled until restart", delivered through its
    own resilience callback, takes the linker down and a restart brings a new
    KVCR."""
    agent = linker.session.agent
    # Queued where kvcr's progress thread reports it; poll_completed delivers it.
    linker._adapter.call(lambda kv: kv._core._resilience_errors.append(STALLED))
    wait_until(
        lambda: (linker.lookup("x", kv_transfer([])), linker.kvcr_down)[1],
        what="linker down",
    )
    assert linker._adapter.stats().resilience_events == 1
    _until_up(linker)
    assert linker.session.agent != agent
    assert linker.stats_snapshot()["kvcr_restarts"] == 1
    _round_trip(linker, pool, "resilient", page=7, dest=23)


def test_failed_restarts_back_off_doubling_to_the_cap():
    state = recovery.Recovery()
    state.went_down(100.0, "test")
    assert state.next_attempt == 100.0 + recovery.BACKOFF_FIRST_S
    waits = [state.attempt_failed(200.0) for _ in range(8)]
    assert waits == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    assert not state.due(259.0) and state.due(260.0)
    state.came_up(restarted=True)
    assert (state.failures, state.restarts, state.down) == (1, 1, False)


def test_offload_results_hold_a_restart_until_stored_ones_are_taken():
    """A restart waits for every deposit, and for every STORED result SGLang has
    not taken (its stored mark is set only then, and the restart must report
    that page removed after it); FAILED results waiting in the FIFO do not."""
    q = OffloadQueue()
    record = q.push()
    record.pending = 1
    q.track(OpId(1), record)
    assert q.has_pending
    ok = {b"k": EntryResult(EntryStatus.SUCCESS)}
    q.on_done(OpDone(OpId(1), OpKind.DEPOSIT, ok))
    assert q.has_pending
    assert q.pop() is True
    assert not q.has_pending
    q.push().fail()
    assert not q.has_pending and q.completed() == 1


def test_a_flush_or_close_after_a_failed_start_raises_nothing(
    pool, linker, monkeypatch
):
    """A flush whose next KVCR does not start leaves the closed adapter in place:
    the next flush and the close still answer (no exception into SGLang's flush
    or shutdown), and the next start that works brings KVCR back."""
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_session import KVCRSession

    real_start = KVCRSession._start
    failing = [True]

    def start(self):
        if failing[0]:
            raise RuntimeError("injected: no control port")
        return real_start(self)

    monkeypatch.setattr(KVCRSession, "_start", start)
    linker.reset()
    assert linker.kvcr_down
    linker.reset()  # again, still failing: answers
    assert linker.kvcr_down
    failing[0] = False
    linker.reset()
    assert not linker.kvcr_down
    _round_trip(linker, pool, "after-failed-start", page=5, dest=21)


def test_a_dram_swap_that_fails_is_redone_by_the_next_restart(
    pool, linker, monkeypatch
):
    """An unclean close quarantines the old share and takes a new one; when
    taking it fails the old share stays where it was and the next restart takes
    it again, so a new KVCR never registers DRAM that is also quarantined."""
    from sglang.srt.mem_cache.storage.kvcr.owner import quarantine
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_session import KVCRSession

    def unclean_close(old):
        old.close()
        return False  # as if a transfer could still write its DRAM

    monkeypatch.setattr(KVCRSession, "_close", staticmethod(unclean_close))
    real_take = quarantine.Quarantine.take
    failing = [True]

    def take(self, name, nbytes):
        if failing[0]:
            raise MemoryError("injected: cannot pin another share")
        return real_take(self, name, nbytes)

    monkeypatch.setattr(quarantine.Quarantine, "take", take)
    old = dict(linker.dram.storage)
    linker._adapter.call(lambda kv: kv._core._resilience_errors.append(STALLED))
    wait_until(
        lambda: (linker.lookup("x", kv_transfer([])), linker.kvcr_down)[1],
        what="linker down",
    )
    linker.recovery.next_attempt = 0.0
    linker.num_completed_offloads()  # the restart's DRAM swap fails
    assert linker.kvcr_down
    assert all(linker.dram.storage[n] is t for n, t in old.items())
    assert linker.dram.quarantine.cores == 0  # nothing quarantined yet
    failing[0] = False
    linker.recovery.next_attempt = 0.0
    _until_up(linker)
    assert all(linker.dram.storage[n] is not t for n, t in old.items())
    assert linker.dram.quarantine.cores == 1
    fresh = {t.data_ptr() for t in linker.dram.storage.values()}
    registered = {addr for _, addr, _ in _kvcr_dram_regions(linker)}
    assert registered <= fresh  # the new KVCR runs on the new share only


def _kvcr_dram_regions(linker):
    return linker.session._factory_args["local_dram_pools"]
