"""The one-copy offload: pool pages straight into KVCR DRAM, READY only after.

KVCR (real kvcr 0.1.1 over CPU tensors) allocates a deposit's slots (one per
page, every span in it) and keeps them FILLING; the linker's copier
(``datapath/dram_copy.py``, driven through ``kvcr_patches/page_fills.py``) writes
them, and only its report lets KVCR mark them READY. Here the copy is held, made late, made to fail and pointed at DRAM
that moved: no slot is ever READY before its bytes landed, a failed or late copy
is a failed offload with its slots freed, and a round trip is byte-exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import random
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from cpu_harness.kvcr_pages import (
    fill_random,
    hashes_for,
    kv_transfer,
    make_linker,
    make_pool,
    offload_and_commit,
    page_bytes,
    prepare,
    restore,
    wait_until,
)
from sglang.srt.mem_cache.storage.kvcr.datapath import copy_jobs, dram_copy
from sglang.srt.mem_cache.storage.kvcr.datapath.copy_jobs import (
    CopyRefused,
    plan_runs,
)
from sglang.srt.mem_cache.storage.kvcr.datapath.dram_copy import DramCopier
from sglang.srt.mem_cache.storage.kvcr.device.device_streams import (
    DeviceBinding,
    DeviceStallError,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import EntryStatus, OpDone
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import (
    batched_slots,
    page_fills,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches.page_fills import SlotRef

pytestmark = pytest.mark.kvcr

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _hold_copies(monkeypatch, fails: bool = False):
    """Every copy waits for ``release`` before moving a byte (then raises, when
    ``fails``); returns ``(started, release)``."""
    release, started = threading.Event(), threading.Event()
    original = DramCopier._issue

    def held(self, job, stream):
        started.set()
        assert release.wait(10), "test never released the copy"
        if fails:
            raise RuntimeError("copy failed (injected)")
        return original(self, job, stream)

    monkeypatch.setattr(DramCopier, "_issue", held)
    return started, release


@pytest.fixture
def held_copy(monkeypatch):
    return _hold_copies(monkeypatch)


def _count_submissions(lk, fail_first: bool = False) -> list[int]:
    """Record the size of every ``submit_together`` the linker makes (the first
    raising, with ``fail_first``); the list fills as submissions happen."""
    calls: list[int] = []
    together = lk._adapter.submit_together

    def counting(deposits, *args, **kwargs):
        calls.append(len(deposits))
        if fail_first and len(calls) == 1:
            raise RuntimeError("owner inbox refused (injected)")
        return together(deposits, *args, **kwargs)

    lk._adapter.submit_together = counting
    return calls


def _resident(lk) -> int:
    return lk.residency.gauges().resident_keys


def _next_result(lk) -> bool:
    """Wait for the next offload result and take it (whether it stored)."""
    wait_until(lambda: lk.num_completed_offloads() >= 1, what="offload result")
    return lk.pop_completed_offload()


def _held_deposit(lk, started, n: int, salt: str) -> None:
    """Offload pages ``1..n`` and pump once: the deposit is submitted and its
    (held) copy has started, nothing answered yet."""
    pages = list(range(1, n + 1))
    assert lk.offload(kv_transfer(hashes_for(n, salt), pages)) is True
    assert lk.num_completed_offloads() == 0  # submitted by this pump
    assert started.wait(5), "the pump did not start the copy"


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_is_byte_exact_and_uses_the_copier(device):
    pool = make_pool(device)
    fill_random(pool, [1, 2, 3], seed=11)
    want = [page_bytes(pool, p).clone() for p in (1, 2, 3)]
    lk = make_linker(pool)
    try:
        hashes = hashes_for(3, "one-copy")
        assert offload_and_commit(lk, hashes, [1, 2, 3], device) is True
        assert lk.copier.copied_bytes == sum(w.numel() for w in want)
        prepare(lk, "r", hashes)
        assert restore(lk, "r", hashes, [4, 5, 6], device) is True
        if device == "cuda":
            torch.cuda.synchronize()
        for p, w in zip((4, 5, 6), want, strict=True):
            assert torch.equal(page_bytes(pool, p), w)
    finally:
        lk.close()


def test_no_slot_is_ready_before_its_copy_landed(held_copy):
    started, release = held_copy
    pool = make_pool()
    fill_random(pool, [1, 2], seed=12)
    lk = make_linker(pool)
    try:
        hashes = hashes_for(2, "held")
        assert lk.offload(kv_transfer(hashes, [1, 2])) is True
        wait_until(lambda: (lk.num_completed_offloads(), started.is_set())[1])
        # KVCR has the slots (FILLING) and the copy has not run: for 0.3 s of owner
        # polls the offload stays unanswered and nothing is a hit.
        for _ in range(30):
            assert lk.num_completed_offloads() == 0
            assert _resident(lk) == 0
            threading.Event().wait(0.01)
        release.set()
        assert _next_result(lk) is True
        wait_until(lambda: _resident(lk) == 2, what="pages resident")
    finally:
        release.set()
        lk.close()


def test_an_offload_leaves_its_deposit_to_the_next_pump(held_copy):
    """``offload`` runs on the scheduler thread before the batch's output is
    streamed: it only queues the offload (even a CPU pool's, which has no fence
    to wait for). Nothing is keyed, the owner thread is not woken and no copy
    starts until the scheduler's next pass pumps (``num_completed_offloads``),
    which submits it; the result arrives through a later pass."""
    started, release = held_copy
    pool = make_pool()
    fill_random(pool, [1, 2], seed=13)
    lk = make_linker(pool)
    submitted = _count_submissions(lk)
    try:
        assert lk.offload(kv_transfer(hashes_for(2, "next-pass"), [1, 2])) is True
        assert lk.offloader.queue.deferred_count == 1
        assert not started.wait(0.2), "offload() started the copy itself"
        assert submitted == []
        assert lk.num_completed_offloads() == 0  # the next pass: submitted now
        assert submitted == [1]
        assert lk.offloader.queue.deferred_count == 0
        assert started.wait(5), "the pump did not start the copy"
        release.set()
        assert _next_result(lk) is True
    finally:
        release.set()
        lk.close()


def _offload(lk, n: int, salt: str) -> None:
    assert lk.offload(kv_transfer(hashes_for(n, salt), list(range(1, n + 1))))


def _batch_result(lk, offload_n: int = 0, salt: str = "") -> None:
    """What SGLang's ``process_batch_result`` hook tells the linker about one
    batch result, offloading pages ``1..offload_n`` from inside it."""
    lk.batch_result_started()
    if offload_n:
        _offload(lk, offload_n, salt)
    lk.batch_done()


def test_a_busy_scheduler_holds_a_deposit_past_the_next_batch(held_copy, monkeypatch):
    """The step right after a prefill shares its output gap with the prefill:
    a deposit run then lengthens the worst inter-token gap a decoding request
    sees. While batches keep coming, a deposit made inside a batch's result
    waits for the next batch result (``offload_hold_batches=1``), one made
    outside any result (an abort's) for the next one as well, and so does the
    first one after an idle pass; in FIFO order, the next pass then submits it."""
    from sglang.srt.mem_cache.storage.kvcr.datapath import offload_queue

    monkeypatch.setattr(offload_queue, "HOLD_MAX_S", 60.0)  # only batches here
    started, release = held_copy
    pool = make_pool()
    fill_random(pool, [1, 2, 3], seed=31)
    lk = make_linker(pool)
    submitted = _count_submissions(lk)
    try:
        _batch_result(lk, 2, "hold-a")
        _batch_result(lk, 3, "hold-b")  # the next step offloads too
        lk.num_completed_offloads()  # the next pass
        assert submitted == [1]  # a: b's batch result came after its own
        assert lk.offloader.queue.deferred_count == 1  # b waits for one more
        assert started.wait(5)
        _batch_result(lk)
        lk.num_completed_offloads()
        assert submitted == [1, 1]
        _offload(lk, 1, "hold-c")  # outside any batch result
        assert lk.num_completed_offloads() == 0
        assert submitted == [1, 1]
        _batch_result(lk)
        lk.num_completed_offloads()
        assert submitted == [1, 1, 1]
        release.set()
        for _ in range(3):
            assert _next_result(lk) is True
        lk.scheduler_idle()  # idle: holds released, none deferred
        _batch_result(lk, 2, "hold-d")  # the first prefill after the idle pass
        assert lk.num_completed_offloads() == 0
        assert submitted == [1, 1, 1]  # held like any other
        _batch_result(lk)
        lk.num_completed_offloads()
        assert submitted == [1, 1, 1, 1]
        assert _next_result(lk) is True
    finally:
        release.set()
        lk.close()


def test_a_deposit_held_for_the_next_batch_waits_for_nothing_else(
    held_copy, monkeypatch
):
    """The hold never outlasts the batches it waits for: an idle scheduler
    (``scheduler_idle``) submits it at once (``idle_offload_delay_us=0``), a
    scheduler that stopped running batches without going idle once
    ``HOLD_MAX_S`` has passed; with ``offload_hold_batches=0``, or a linker no
    scheduler reports batches to, there is no hold at all."""
    from sglang.srt.mem_cache.storage.kvcr.datapath import offload_queue

    _, release = held_copy
    release.set()  # copies run at once here: only submissions are counted
    pool = make_pool()
    fill_random(pool, [1, 2], seed=32)
    monkeypatch.setattr(offload_queue, "HOLD_MAX_S", 60.0)  # aged below
    held = make_linker(pool, idle_offload_delay_us=0)
    unheld = make_linker(pool, offload_hold_batches=0)
    direct = make_linker(pool)  # nobody reports batches to it
    try:
        for lk, salt in ((held, "idle"), (held, "late")):
            submitted = _count_submissions(lk)
            _batch_result(lk, 2, salt)
            assert lk.num_completed_offloads() == 0
            assert submitted == []  # held
            if salt == "idle":
                lk.scheduler_idle()
            else:  # deferred HOLD_MAX_S ago, no batch since
                _age(lk, 0, 61.0)
                lk.num_completed_offloads()
            assert submitted == [1]
            assert _next_result(lk) is True
        for lk, salt in ((unheld, "no-hold"), (direct, "direct")):
            submitted = _count_submissions(lk)
            if lk is unheld:
                _batch_result(lk, 2, salt)
            else:
                _offload(lk, 2, salt)
            lk.num_completed_offloads()
            assert submitted == [1]
            assert _next_result(lk) is True
    finally:
        release.set()
        for lk in (held, unheld, direct):
            lk.close()


def _age(lk, i: int, seconds: float) -> None:
    """Make deferred offload ``i`` of ``lk`` as if made ``seconds`` earlier (a
    negative value: later, however long the test thread was held up)."""
    queue = lk.offloader.queue
    queue._deferred[i] = dataclasses.replace(
        queue._deferred[i], since=queue._deferred[i].since - seconds
    )


def test_an_idle_scheduler_lets_the_batch_output_go_before_the_deposit(
    held_copy, monkeypatch
):
    """The batch's output is still on its way to the client (detokenizer,
    tokenizer manager, HTTP) when the scheduler first goes idle, and a deposit
    then (the owner and copier threads, the GIL, a core) would slow it: an idle
    pass submits a deposit only once ``idle_offload_delay_us`` has passed since
    its offload, in order, without blocking meanwhile; a later offload still
    inside its delay stays held while an older one goes. An idle pass before
    SGLang sleeps (``--sleep-on-idle``) submits at once."""
    from sglang.srt.mem_cache.storage.kvcr.datapath import offload_queue

    _, release = held_copy
    release.set()  # copies run at once here: only submissions are counted
    pool = make_pool()
    fill_random(pool, [1, 2, 3], seed=33)
    monkeypatch.setattr(offload_queue, "HOLD_MAX_S", 60.0)  # only the delay here
    lk = make_linker(pool, idle_offload_delay_us=5000)
    submitted = _count_submissions(lk)
    try:
        lk.batch_result_started()  # a and b, from one batch's result
        _offload(lk, 2, "delay-a")
        _offload(lk, 3, "delay-b")
        lk.batch_done()
        _age(lk, 0, -60.0)  # just made, whatever the test thread's pace
        _age(lk, 1, -60.0)
        lk.scheduler_idle()
        assert submitted == []  # the output first
        assert lk.offloader.queue.deferred_count == 2
        _age(lk, 0, 60.0 + 0.005)  # a's delay has passed, b's has not
        lk.scheduler_idle()
        assert submitted == [1]  # a alone
        assert lk.offloader.queue.deferred_count == 1
        _age(lk, 0, 60.0 + 0.005)
        lk.scheduler_idle()
        assert submitted == [1, 1]
        # SGLang's idle loop is about to sleep until a request comes
        # (--sleep-on-idle): no later idle pass would submit it, so it goes now.
        _batch_result(lk, 2, "delay-c")
        _age(lk, 0, -60.0)
        lk.scheduler_idle(sleeps=True)
        assert submitted == [1, 1, 1]
        for _ in range(3):
            assert _next_result(lk) is True
    finally:
        release.set()
        lk.close()


def test_a_batch_result_inside_another_leaves_the_outer_one_open():
    """An offload after a nested result ended, still inside the outer one,
    waits for the outer result and one more (the bracket is a depth)."""
    from sglang.srt.mem_cache.storage.kvcr.datapath.offload_queue import BatchHold

    hold = BatchHold(hold_batches=1, batches=5)
    hold.result_started()
    hold.result_started()
    hold.result_done()  # the inner result: batches 6
    assert hold.stamp() == (1, 6 + 1 + 1)
    hold.result_done()
    assert hold.stamp() == (2, 7 + 1)


def test_an_idle_pass_blocks_until_the_deposit_in_flight_is_answered(held_copy):
    """SGLang's idle loop spins holding the GIL; ``scheduler_idle`` (its
    ``on_idle`` hook) blocks instead while a deposit is in flight, so the owner
    and copier finish it between requests: it returns once the result came back
    and was routed (the offload is complete without another pump). With no
    deposit in flight it does not wait at all."""
    started, release = held_copy
    pool = make_pool()
    fill_random(pool, [1, 2], seed=16)
    lk = make_linker(pool)
    lk._idle_wait_s = 30.0  # the bound is the next test's; here only the answer
    drains: list[float] = []
    drain = lk._adapter.drain

    def counted(wait_s: float = 0.0):
        drains.append(wait_s)
        return drain(wait_s)

    lk._adapter.drain = counted
    try:
        lk.scheduler_idle()  # nothing in flight
        assert drains == []
        assert lk.stats.idle_offload_waits == 0
        _held_deposit(lk, started, 2, "idle-pass")
        began = time.monotonic()
        threading.Timer(0.05, release.set).start()
        lk.scheduler_idle()
        assert time.monotonic() - began >= 0.05  # it waited for the copy
        assert any(wait > 0 for wait in drains)
        assert lk.offloader.queue.completed() == 1  # answered and routed
        assert lk.stats.idle_offload_waits == 1
        assert lk.pop_completed_offload() is True
    finally:
        release.set()
        lk.close()


def test_an_idle_pass_waits_no_longer_than_idle_offload_wait_us(held_copy):
    """A copy that does not end in time: the idle pass returns after its bound
    (a request arriving meanwhile waits that long at most) and the offload is
    still in flight, answered later."""
    started, release = held_copy
    pool = make_pool()
    fill_random(pool, [1], seed=17)
    lk = make_linker(pool, idle_offload_wait_us=20000)
    try:
        _held_deposit(lk, started, 1, "idle-bound")
        began = time.monotonic()
        lk.scheduler_idle()
        waited = time.monotonic() - began
        assert 0.019 <= waited < 2.0
        assert lk.offloader.queue.deposits_in_flight
        assert lk.num_completed_offloads() == 0
        release.set()
        assert _next_result(lk) is True
    finally:
        release.set()
        lk.close()


def test_a_flush_before_the_next_pump_drops_the_deferred_offload_unsubmitted():
    """SGLang flushes from ``ingest_requests``, before the step's pump: a CPU
    pool's offload queued by the last batch is then still deferred. The flush
    drops it without a deposit (no copy can read pages the allocator is about to
    free), stores nothing, leaves no result to pair (the wrapper fails its
    pending offloads itself), and the next offload gets its own result."""
    pool = make_pool()
    fill_random(pool, [1, 2, 3], seed=23)
    lk = make_linker(pool)
    submitted = _count_submissions(lk)
    try:
        dropped = hashes_for(2, "flushed")
        assert lk.offload(kv_transfer(dropped, [1, 2])) is True
        assert lk.offloader.queue.deferred_count == 1
        lk.reset()
        assert submitted == []
        assert lk.offloader.queue.deferred_count == 0
        assert len(lk.offloader.queue) == 0
        assert lk.num_completed_offloads() == 0
        assert _resident(lk) == 0
        kept = hashes_for(1, "after-flush")
        assert lk.offload(kv_transfer(kept, [3])) is True
        assert _next_result(lk) is True
        assert _resident(lk) == 1
    finally:
        lk.close()


def test_a_local_hit_enqueued_after_an_offload_gets_its_claims_first():
    """The step after a batch offloaded: a request enqueued then (before the
    step's pump) whose pages are resident here is ready at once, its claims
    answered while the batch's deposit is still deferred (the owner thread does
    not reserve and copy it first); the step's pump then submits the deposit."""
    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
        LinkerRequestContext,
    )

    pool = make_pool()
    fill_random(pool, [1, 2, 3, 4], seed=29)
    lk = make_linker(pool)
    try:
        resident = hashes_for(2, "resident")
        assert offload_and_commit(lk, resident, [1, 2]) is True
        lk.num_completed_offloads()  # a step starts: this step's claim wait
        assert lk.offload(kv_transfer(hashes_for(2, "later"), [3, 4])) is True
        handle = lk.prepare_request(LinkerRequestContext("hit"), kv_transfer(resident))
        assert lk.offloader.queue.deferred_count == 1
        assert lk.preparations.ready(handle)  # claimed, no deposit submitted
        assert lk.preparation_ready(handle)  # the step's pump: submitted now
        assert lk.offloader.queue.deferred_count == 0
        assert lk.lookup("hit", kv_transfer(resident)) == [1, 2]
        assert _next_result(lk) is True
        lk.release_request("hit")
    finally:
        lk.close()


def test_an_offload_whose_submission_raises_fails_and_is_not_awaited():
    """Handing a deferred offload's deposits to the owner raised: that offload
    fails, and nothing of it stays pending (a pending op would hold off a KVCR
    restart until the next flush); the next offload is stored."""
    pool = make_pool()
    fill_random(pool, [1, 2], seed=31)
    lk = make_linker(pool)
    calls = _count_submissions(lk, fail_first=True)
    try:
        assert lk.offload(kv_transfer(hashes_for(1, "refused"), [1])) is True
        assert lk.num_completed_offloads() == 1
        assert lk.pop_completed_offload() is False
        assert not lk.offloader.queue.has_pending
        assert lk.offload(kv_transfer(hashes_for(1, "stored"), [2])) is True
        assert _next_result(lk) is True
        assert calls == [1, 1]
    finally:
        lk.close()


def test_a_deposit_larger_than_a_chunk_copies_while_it_reserves(monkeypatch):
    """With chunks (a device copier's: ``DEVICE_CHUNKS``, set here on a CPU one)
    a 20-page deposit reserves 8, then 12, each copy queued as soon as its slots
    are reserved (before the next chunk is): each chunk is READY only once its
    own copy landed, and a failed chunk fails only its own pages (the offload is
    not stored)."""
    first, later = DramCopier.DEVICE_CHUNKS
    pages = list(range(1, 21))
    rest = len(pages) - first
    assert 0 < rest <= later
    order: list[str] = []
    reserve = batched_slots.reserve
    start, issue = DramCopier.start, DramCopier._issue

    def reserving(core, keys, *args, **kwargs):
        order.append(f"reserve {len(keys)}")
        return reserve(core, keys, *args, **kwargs)

    def starting(self, pairs, *args, **kwargs):
        order.append(f"queue {len(pairs)}")
        return start(self, pairs, *args, **kwargs)

    def copying(self, job, stream):
        if len(job.pairs) != first:
            raise RuntimeError("second chunk's copy failed (injected)")
        return issue(self, job, stream)

    monkeypatch.setattr(batched_slots, "reserve", reserving)
    monkeypatch.setattr(DramCopier, "start", starting)
    monkeypatch.setattr(DramCopier, "_issue", copying)
    pool = make_pool()
    fill_random(pool, pages, seed=18)
    want = {p: page_bytes(pool, p).clone() for p in pages[:first]}
    lk = make_linker(pool)
    try:
        assert lk.copier.chunks is None  # a CPU copier reserves a deposit at once
        lk.copier.chunks = DramCopier.DEVICE_CHUNKS
        hashes = hashes_for(len(pages), "chunks")
        assert lk.offload(kv_transfer(hashes, pages)) is True
        assert _next_result(lk) is False  # a chunk failed
        assert order == [
            f"reserve {first}",
            f"queue {first}",
            f"reserve {rest}",
            f"queue {rest}",
        ]
        wait_until(lambda: _resident(lk) == first, what="first chunk resident")
        # The first chunk's pages come back byte-exact; the failed ones miss.
        prepare(lk, "c", hashes[:first])
        dest = list(range(40, 40 + first))
        assert restore(lk, "c", hashes[:first], dest) is True
        assert all(
            torch.equal(page_bytes(pool, d), want[p])
            for d, p in zip(dest, pages, strict=False)
        )
        assert _resident(lk) == first
    finally:
        lk.close()


def test_a_deposit_failing_midway_keeps_its_running_copy_seen_at_close(
    monkeypatch, held_copy
):
    """kvcr raises while a chunked deposit reserves its second chunk, with the
    first chunk's copy already running: the owner thread fails, and its close
    still sees that copy (waits for it, then calls the close unclean) instead of
    calling KVCR quiescent while the copy writes its DRAM."""
    started, release = held_copy
    calls: list[int] = []
    reserve = batched_slots.reserve

    def flaky(core, keys, *args, **kwargs):
        calls.append(len(keys))
        if len(calls) == 2:
            # Once the first chunk's copy runs (a copy not started would just be
            # dropped at close, never writing).
            assert started.wait(5), "the first chunk's copy never started"
            raise RuntimeError("kvcr state broken (injected)")
        return reserve(core, keys, *args, **kwargs)

    monkeypatch.setattr(batched_slots, "reserve", flaky)
    pages = list(range(1, 21))
    pool = make_pool()
    fill_random(pool, pages, seed=19)
    lk = make_linker(pool, owner_wait_timeout_s=2.0)
    try:
        lk.copier.chunks = DramCopier.DEVICE_CHUNKS
        assert lk.offload(kv_transfer(hashes_for(20, "midway"), pages)) is True
        lk.num_completed_offloads()  # the next pass submits it
        assert started.wait(5), "the first chunk's copy never started"
        wait_until(lambda: len(calls) == 2, what="second reservation")
        wait_until(lambda: not lk._adapter._thread.is_alive(), what="owner stop")
        assert lk._adapter.failed
        assert lk._adapter._clean_close is False  # the copy still writes
        release.set()
        wait_until(lambda: lk.num_completed_offloads() >= 1, what="failed result")
        assert lk.pop_completed_offload() is False
    finally:
        release.set()
        lk.close()


def test_a_copy_not_started_by_its_deadline_fails_and_frees_its_slots(held_copy):
    """A copy still queued at its deadline is dropped unwritten (failed, slots
    freed); one already running is waited for and counts as it ends."""
    started, release = held_copy
    pool = make_pool()
    fill_random(pool, [1, 2], seed=13)
    lk = make_linker(pool, operation_timeout_ms=300, abandon_timeout_ms=600)
    try:
        first = hashes_for(2, "late")
        assert lk.offload(kv_transfer(first, [1, 2])) is True
        # A second offload queued behind the held one is past its deadline when
        # the copier reaches it: it is dropped unwritten.
        second = hashes_for(2, "late-2")
        assert lk.offload(kv_transfer(second, [1, 2])) is True
        wait_until(lambda: (lk.num_completed_offloads(), started.is_set())[1])
        threading.Event().wait(0.6)  # both deadlines pass
        release.set()
        wait_until(lambda: lk.num_completed_offloads() >= 2, what="both results")
        assert lk.pop_completed_offload() is True  # running at its deadline: landed
        assert lk.pop_completed_offload() is False  # never started
        wait_until(lambda: _resident(lk) == 2, what="the landed pages")
        assert lk.lookup("none", kv_transfer(second)) == []
        assert lk.claims_outstanding() == 0
        # The dropped one's slots came back: a fresh offload is stored.
        assert offload_and_commit(lk, hashes_for(2, "after"), [1, 2]) is True
    finally:
        release.set()
        lk.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_copy_is_a_failed_offload(monkeypatch, device):
    """A copy that raises part way (after its first run was queued, on CUDA)
    fails the offload: no READY slot, nothing to restore."""
    original = DramCopier._copy_pages_device

    def broken_device(self, *args):
        original(self, *args)
        raise RuntimeError("copy failed (injected)")

    def broken(self, job, stream):
        raise RuntimeError("copy failed (injected)")

    if device == "cuda":
        monkeypatch.setattr(DramCopier, "_copy_pages_device", broken_device)
    else:
        monkeypatch.setattr(DramCopier, "_issue", broken)
    pool = make_pool(device)
    fill_random(pool, [1], seed=14)
    lk = make_linker(pool)
    try:
        hashes = hashes_for(1, "broken")
        assert offload_and_commit(lk, hashes, [1], device) is False
        assert _resident(lk) == 0
        assert lk.lookup("none", kv_transfer(hashes)) == []
    finally:
        lk.close()


def test_a_copier_without_its_device_fails_offloads(monkeypatch):
    def lost(self):
        raise RuntimeError("CUDA error: device lost (injected)")

    monkeypatch.setattr(DeviceBinding, "bind_thread", lost)
    pool = make_pool()
    fill_random(pool, [1], seed=15)
    lk = make_linker(pool)
    try:
        assert offload_and_commit(lk, hashes_for(1, "lost"), [1]) is False
        assert _resident(lk) == 0
    finally:
        lk.close()


def _copier(rows, storage):
    return DramCopier(rows, lambda: storage, DeviceBinding.of(torch.device("cpu")))


def _copy_one(copier, stores, page: int, slot: int) -> bool | None:
    """Copy pool page ``page`` into slot ``slot`` of the current ``kv`` DRAM;
    whether it landed."""
    ref = SlotRef("kv", stores["kv"].data_ptr(), 16, slot)
    job = copier.start([(page, ref)], deadline=float("inf"))
    wait_until(lambda: job.poll() is not None, what="job")
    return job.poll()


def test_dram_that_moved_is_never_written():
    parts = {"kv": [torch.arange(64, dtype=torch.uint8).view(4, 16)]}
    store = torch.zeros(8 * 16, dtype=torch.uint8)
    copier = _copier(parts, {"kv": store})
    try:
        stale = SlotRef("kv", store.data_ptr() + 4096, 16, 0)
        job = copier.start([(1, stale)], deadline=float("inf"))
        wait_until(lambda: job.poll() is not None, what="job")
        assert job.poll() is False
        assert int(store.count_nonzero()) == 0
    finally:
        assert copier.close(5)


def test_cpu_slot_views_are_built_once_per_dram_and_keep_no_replaced_dram_alive():
    """The copier builds a CPU pool's slot views once and reuses them while its
    DRAM stays; they own nothing, so a replaced DRAM is freed, and the next job
    writes the new DRAM through new views."""
    page_rows = torch.arange(64, dtype=torch.uint8).view(4, 16) + 1
    memory = np.zeros(8 * 16, dtype=np.uint8)  # alive while any storage of it is
    gone = weakref.ref(memory)
    stores = {"kv": torch.from_numpy(memory)}
    del memory
    copier = _copier({"kv": [page_rows]}, stores)
    try:
        assert _copy_one(copier, stores, 1, 2) is True
        first = copier._views["kv"]
        assert _copy_one(copier, stores, 2, 5) is True
        assert copier._views["kv"] is first  # reused, not rebuilt per job
        old = stores["kv"].view(8, 16)
        assert torch.equal(old[2], page_rows[1]) and torch.equal(old[5], page_rows[2])
        del old
        stores["kv"] = torch.zeros(16 * 16, dtype=torch.uint8)  # a new DRAM
        gc.collect()
        assert gone() is None  # the copier's views kept the old DRAM alive
        assert _copy_one(copier, stores, 3, 12) is True  # only the new DRAM has it
        assert copier._views["kv"] is not first
        new = stores["kv"].view(16, 16)
        assert torch.equal(new[12], page_rows[3])
        assert int(new.count_nonzero()) == int(page_rows[3].count_nonzero())
    finally:
        assert copier.close(5)


def test_a_cpu_copy_writes_the_dram_it_checked_never_a_replaced_one_of_equal_size():
    """A DRAM replaced by one of the same size at another address (the old one
    still held, as after an unclean close) gets new views: the next deposit
    lands in the new DRAM and leaves the old one as it was. A DRAM that is not
    dense host memory is refused, never written through a raw address view."""
    page_rows = torch.arange(64, dtype=torch.uint8).view(4, 16) + 1
    old = torch.zeros(8 * 16, dtype=torch.uint8)
    stores = {"kv": old}
    copier = _copier({"kv": [page_rows]}, stores)
    try:
        assert _copy_one(copier, stores, 1, 2) is True
        new = torch.zeros(8 * 16, dtype=torch.uint8)  # same size, old kept alive
        stores["kv"] = new
        assert _copy_one(copier, stores, 3, 2) is True
        assert torch.equal(new.view(8, 16)[2], page_rows[3])
        assert torch.equal(old.view(8, 16)[2], page_rows[1])  # untouched
        backing = torch.zeros(2 * 8 * 16, dtype=torch.uint8)
        stores["kv"] = backing[::2]  # strided: not dense
        assert _copy_one(copier, stores, 2, 4) is False
        assert int(backing.count_nonzero()) == 0
    finally:
        assert copier.close(5)


class _StreamStandIn:
    """Stands in for a CUDA side stream: always drained."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@dataclasses.dataclass(frozen=True, slots=True)
class _CudaHostStandIn(DeviceBinding):
    """A copier bound to a device (it has a stream) whose sources are host rows,
    as a staged offload's staging area on a CUDA host."""

    def start_side_thread(self, what: str):
        return _StreamStandIn(), None

    @contextlib.contextmanager
    def on(self, stream):
        yield


def test_a_device_copier_moves_host_staging_rows_with_the_host_copy(monkeypatch):
    """On a CUDA host a staged offload's sources are page-locked host rows: they
    take the host copy straight into the slots, never the device path (a
    32 MiB scratch and three host passes per byte)."""

    def device_path(self, group):
        raise AssertionError("host rows sent down the device path")

    monkeypatch.setattr(DramCopier, "_copy_pages_device", device_path)
    page_rows = torch.arange(64, dtype=torch.uint8).view(4, 16) + 1
    stores = {"kv": torch.zeros(8 * 16, dtype=torch.uint8)}
    copier = DramCopier(
        {"kv": [page_rows]}, lambda: stores, _CudaHostStandIn(torch.device("cpu"))
    )
    try:
        assert _copy_one(copier, stores, 3, 5) is True
        assert torch.equal(stores["kv"].view(8, 16)[5], page_rows[3])
    finally:
        assert copier.close(5)


class _HeldEvent:
    """Stands in for the event after a job's queued copies: done when set."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        assert self.done.is_set()


@dataclasses.dataclass(frozen=True, slots=True)
class _QueuedCopies(_CudaHostStandIn):
    """A device copier whose queued copies end only when the test says: each
    job's end event is held (``events``, in issue order)."""

    events: list = dataclasses.field(default_factory=list)

    def mark(self, stream):
        event = _HeldEvent()
        self.events.append(event)
        return event


def test_a_job_is_queued_while_the_one_before_still_copies():
    """The copier queues a job's copies while the previous job's are still in
    flight (the copy engine never waits for this thread to launch), and no job
    reports before the event after its own copies: the first reports landed only
    once its event completed, the second only after its own."""
    page_rows = torch.arange(64, dtype=torch.uint8).view(4, 16) + 1
    stores = {"kv": torch.zeros(8 * 16, dtype=torch.uint8)}
    binding = _QueuedCopies(torch.device("cpu"))
    copier = DramCopier({"kv": [page_rows]}, lambda: stores, binding)
    slots = stores["kv"].view(8, 16)
    try:

        def start(page: int, slot: int):
            ref = SlotRef("kv", stores["kv"].data_ptr(), 16, slot)
            return copier.start([(page, ref)], deadline=float("inf"))

        first = start(1, 2)
        wait_until(lambda: len(binding.events) == 1, what="first job queued")
        time.sleep(0.05)  # the copier now waits for the first job's copies
        second = start(3, 5)
        # The second job's copies are queued (here: run inline) at once.
        wait_until(lambda: len(binding.events) == 2, what="second job queued")
        assert torch.equal(slots[5], page_rows[3])
        time.sleep(0.05)
        assert first.poll() is None and second.poll() is None
        binding.events[0].done.set()
        wait_until(lambda: first.poll() is not None, what="first job settled")
        assert first.poll() is True
        time.sleep(0.05)
        assert second.poll() is None  # its own copies have not ended yet
        binding.events[1].done.set()
        wait_until(lambda: second.poll() is not None, what="second job settled")
        assert second.poll() is True and copier.copied_bytes == 32
    finally:
        for event in binding.events:
            event.done.set()
        assert copier.close(5)


class _FailingEvent(_HeldEvent):
    """An event whose query reports a device error (a sticky CUDA fault)."""

    def query(self) -> bool:
        raise RuntimeError("CUDA error: an illegal memory access (injected)")


@dataclasses.dataclass(frozen=True, slots=True)
class _FaultyDevice(_QueuedCopies):
    def mark(self, stream):
        event = _FailingEvent()
        self.events.append(event)
        return event


def test_a_device_error_while_a_copy_is_in_flight_wedges_the_copier():
    """The event after a job's copies reports a device error: that job never
    reports (its slots may still be written), the copier is wedged (the linker
    goes down), a later job fails at once, and close says a copy may still run."""
    page_rows = torch.arange(64, dtype=torch.uint8).view(4, 16) + 1
    stores = {"kv": torch.zeros(8 * 16, dtype=torch.uint8)}
    binding = _FaultyDevice(torch.device("cpu"))
    copier = DramCopier({"kv": [page_rows]}, lambda: stores, binding)
    ref = SlotRef("kv", stores["kv"].data_ptr(), 16, 2)
    try:
        first = copier.start([(1, ref)], deadline=float("inf"))
        wait_until(lambda: copier.wedged, what="copier wedged")
        assert first.poll() is None and first.state is copy_jobs.JobState.RUNNING
        later = copier.start([(3, SlotRef("kv", ref.address, 16, 5))], float("inf"))
        wait_until(lambda: later.poll() is not None, what="later job failed")
        assert later.poll() is False
    finally:
        assert copier.close(5) is False


def test_pages_land_in_their_slots_whatever_the_order():
    """Property: any pages into any distinct slots (runs, strides, singles), each
    slot holding every span of its page in span order."""
    rng = random.Random(5)
    interesting = scattered = 0
    for case in range(60):
        nparts, row = rng.choice([1, 2, 3]), rng.choice([12, 16, 24, 64])
        spans = [
            torch.randint(0, 255, (32, row), dtype=torch.uint8) for _ in range(nparts)
        ]
        slot_bytes = nparts * row
        store = torch.zeros(96 * slot_bytes, dtype=torch.uint8)
        n = rng.randint(1, 40)
        slots = rng.sample(range(96), n)
        if case % 2:
            slots.sort()
        pages = [rng.randrange(32) for _ in range(n)]
        refs = [SlotRef("kv", store.data_ptr(), slot_bytes, s) for s in slots]
        interesting += len(plan_runs(sorted(slots))) < len(slots)
        ordered = sorted(slots)
        breaks = sum(b != a + 1 for a, b in itertools.pairwise(ordered))
        scattered += breaks >= 8  # many runs of consecutive slots: many ops
        copier = _copier({"kv": spans}, {"kv": store})
        try:
            job = copier.start(list(zip(pages, refs)), deadline=float("inf"))
            if case % 3 == 2:
                # The CUDA path's assembly (scratch laid out as the slots, chunked
                # by its size), run here on CPU tensors: the same placement.
                copier.gather.scratch_bytes = rng.choice([1, 2, 5]) * slot_bytes
                copier.gather.in_place = case % 2 == 0  # both gathers
                job.cancel()
                for group in copier._groups(job):
                    copier._copy_pages_device(group)
            else:
                wait_until(lambda j=job: j.poll() is not None, what="job")
                assert job.poll() is True
        finally:
            assert copier.close(5)
        view = store.view(96, slot_bytes)
        for page, slot in zip(pages, slots, strict=True):
            assert torch.equal(view[slot], torch.cat([s[page] for s in spans]))
        untouched = set(range(96)) - set(slots)
        assert all(int(view[s].count_nonzero()) == 0 for s in untouched)
    assert interesting >= 20  # most cases had multi-slot runs, not only singles
    assert scattered >= 10  # and many were split into many runs


def test_plan_runs_splits_on_stride_changes():
    assert plan_runs([0, 2, 4, 5, 6, 9]) == [(0, 3, 2), (3, 5, 1), (5, 6, 1)]
    assert plan_runs([3]) == [(0, 1, 1)]
    assert plan_runs([]) == []


def test_a_pair_the_copier_cannot_write_is_refused():
    parts = {"kv": [torch.zeros(4, 16, dtype=torch.uint8)]}
    store = torch.zeros(8 * 16, dtype=torch.uint8)
    copier = _copier(parts, {"kv": store})
    try:
        for pool, page, size, slot in (
            ("kv9", 0, 16, 0),  # no such pool
            ("kv", 7, 16, 0),  # no such page
            ("kv", 0, 32, 0),  # a slot of another size
            ("kv", 0, 16, 8),  # no such slot
        ):
            job = copy_jobs.CopyJob(
                [(page, SlotRef(pool, store.data_ptr(), size, slot))], float("inf")
            )
            with pytest.raises(CopyRefused):
                copier._groups(job)
        ref = SlotRef("kv", store.data_ptr(), 16, 3)
        twice = copy_jobs.CopyJob([(0, ref), (1, ref)], float("inf"))
        with pytest.raises(CopyRefused, match="named twice"):
            copier._groups(twice)  # two pages into one slot: neither is written
        # One job naming one pool at two places (checked once per pool, not per
        # pair: the second place is refused, not taken for the first's).
        elsewhere = SlotRef("kv", store.data_ptr() + 16, 16, 1)
        split = copy_jobs.CopyJob([(0, ref), (1, elsewhere)], float("inf"))
        with pytest.raises(CopyRefused, match="was replaced"):
            copier._groups(split)
        # A later pair of an already checked pool still has its page and its
        # slot checked.
        for later, why in (
            ((7, SlotRef("kv", store.data_ptr(), 16, 4)), "no page 7"),
            ((1, SlotRef("kv", store.data_ptr(), 16, 8)), "slot 8 is outside"),
        ):
            job = copy_jobs.CopyJob([(0, ref), later], float("inf"))
            with pytest.raises(CopyRefused, match=why):
                copier._groups(job)
    finally:
        assert copier.close(5)


def test_install_refuses_another_kvcr(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(page_fills, "_installed", False)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.2.0")
    with pytest.raises(page_fills.PageFillUnsupported, match=r"kvcr==0\.1\.1"):
        page_fills.install()


def test_a_wedged_copier_fails_its_offloads_and_takes_the_linker_down(monkeypatch):
    """A copy fails and its stream will not drain (the device is wedged): that
    job's slots are never freed, later jobs fail at once, the offload results do
    not wait for answers that never come, and the linker stops using KVCR."""

    def broken(self, job, stream):
        raise RuntimeError("copy failed (injected)")

    def stalled(stream, timeout_s=0.0):
        raise DeviceStallError("stream did not drain (injected)")

    monkeypatch.setattr(DramCopier, "_issue", broken)
    monkeypatch.setattr(dram_copy, "drain", stalled)
    pool = make_pool()
    fill_random(pool, [1, 2], seed=16)
    # The close waits a quarter of this for the wedged copy (never ends).
    lk = make_linker(pool, owner_wait_timeout_s=2.0)
    try:
        assert lk.offload(kv_transfer(hashes_for(1, "wedge"), [1])) is True
        wait_until(lambda: (lk.num_completed_offloads(), lk.copier.wedged)[1])
        wait_until(lambda: lk.num_completed_offloads() >= 1, what="failed result")
        assert lk.pop_completed_offload() is False
        assert lk.kvcr_down
        assert _resident(lk) == 0
        assert lk.offload(kv_transfer(hashes_for(1, "after"), [2])) is True
        wait_until(lambda: lk.num_completed_offloads() >= 1, what="refused offload")
        assert lk.pop_completed_offload() is False
        assert lk.copier.close(1) is False  # a copy may still write its slots
    finally:
        lk.close()


@pytest.mark.parametrize("lands", [True, False])
def test_an_offload_of_pages_still_filling_reports_that_fill(monkeypatch, lands):
    """The same pages offloaded again while their first copy is held: the
    second deposit does not copy them again and reports the first copy's
    outcome (stored if it landed, failed if it did not)."""
    started, release = _hold_copies(monkeypatch, fails=not lands)
    waiting: list[int] = []  # each deposit's keys found FILLING by its begin
    begin = page_fills.begin

    def spying(kv, fill, *args, **kwargs):
        begin(kv, fill, *args, **kwargs)
        waiting.append(len(fill.waiting))

    monkeypatch.setattr(page_fills, "begin", spying)
    pool = make_pool()
    fill_random(pool, [1, 2], seed=17)
    lk = make_linker(pool)
    try:
        hashes = hashes_for(2, "twice")
        assert lk.offload(kv_transfer(hashes, [1, 2])) is True
        wait_until(lambda: (lk.num_completed_offloads(), started.is_set())[1])
        assert lk.offload(kv_transfer(hashes, [1, 2])) is True
        lk.num_completed_offloads()  # the next pass submits it, copy still held
        assert lk.offloader.queue.deferred_count == 0
        wait_until(lambda: len(waiting) == 2, what="second deposit begun")
        assert waiting == [0, 2]  # the second found both pages still filling
        release.set()
        wait_until(lambda: lk.num_completed_offloads() >= 2, what="both results")
        assert lk.pop_completed_offload() is lands
        assert lk.pop_completed_offload() is lands
        assert lk.copier.copied_bytes == (2 * lk.layout.page_total if lands else 0)
    finally:
        release.set()
        lk.close()


def test_a_close_waits_for_a_running_copy_and_quarantines_one_it_outlives(
    held_copy,
):
    """Closing while a deposit's copy runs: the close waits for it (bounded by
    owner_wait_timeout_s); a copy still running then keeps the DRAM out of use
    (quarantined), never freed under the copy."""
    started, release = held_copy
    pool = make_pool()
    fill_random(pool, [1], seed=18)
    lk = make_linker(pool, owner_wait_timeout_s=1.0)
    try:
        assert lk.offload(kv_transfer(hashes_for(1, "closing"), [1])) is True
        wait_until(lambda: (lk.num_completed_offloads(), started.is_set())[1])
        adapter = lk._adapter
        assert adapter.close() is False  # the copy outlived the wait
        # Its deposit is answered all the same (nothing waits on a closed KVCR).
        done = [d for d in adapter.drain() if isinstance(d, OpDone)]
        statuses = [e.status for d in done for e in d.entries.values()]
        assert statuses == [EntryStatus.FAILED] * len(lk.layout.pools)
        assert adapter.retained is not None
        assert adapter.reclaim(0.5) is False  # still writing
        release.set()
        wait_until(lambda: adapter.reclaim(0.5), what="reclaimed once copied")
    finally:
        release.set()
        lk.close()


def test_a_kvcr_that_attach_refuses_is_closed_not_left_running(monkeypatch):
    """The policy check runs once KVCR is built: when it refuses, that KVCR (its
    NIXL agent, progress thread, DRAM) is closed, and the refusal names the
    config field."""
    from kvcr import api

    closed: list[object] = []
    close = api.KVCR.close

    def spy(self, *args, **kwargs):
        closed.append(self)
        return close(self, *args, **kwargs)

    monkeypatch.setattr(api.KVCR, "close", spy)
    monkeypatch.setattr(batched_slots, "builtin_policy", lambda core: False)
    with pytest.raises(Exception, match="eviction_policy") as refused:
        make_linker(make_pool())
    assert len(closed) == 1, (closed, refused.value)
