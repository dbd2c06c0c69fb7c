"""A local hit is admitted in the pass it was prepared in (issue 23, deliver 2).

Pages resident in this worker's KVCR DRAM only need claims, which the owner
thread answers at once; ``prepare_request`` waits for that answer (bounded by
``local_hit_wait_ms``) instead of leaving the request for the next scheduling
pass. Real kvcr 0.1.1 over CPU tensors.
"""

from __future__ import annotations

import threading
import time

import pytest

from cpu_harness.kvcr_pages import (
    fill_random,
    hashes_for,
    kv_transfer,
    make_linker,
    make_pool,
    offload_and_commit,
    restore,
    wait_until,
)
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
)

pytestmark = pytest.mark.kvcr


def _stored(lk, pool, n, salt):
    fill_random(pool, list(range(1, n + 1)), seed=21)
    hashes = hashes_for(n, salt)
    assert offload_and_commit(lk, hashes, list(range(1, n + 1))) is True
    wait_until(lambda: lk.residency.gauges().resident_keys == n, what="resident")
    return hashes


def test_a_local_hit_is_ready_at_its_first_readiness_check():
    pool = make_pool()
    lk = make_linker(pool)
    try:
        hashes = _stored(lk, pool, 4, "same-pass")
        for i in range(10):
            lk.num_completed_offloads()  # a scheduler step (its wait budget)
            rid = f"r{i}"
            handle = lk.prepare_request(LinkerRequestContext(rid), kv_transfer(hashes))
            assert lk.preparation_ready(handle) is True, f"attempt {i} held a pass"
            assert lk.lookup(rid, kv_transfer(hashes)) == [1, 2, 3, 4]
            lk.release_request(rid)
        assert lk.stats.local_hit_waits_expired == 0
        handle = lk.prepare_request(LinkerRequestContext("x"), kv_transfer(hashes))
        assert lk.preparation_ready(handle)
        assert restore(lk, "x", hashes, [5, 6, 7, 8]) is True
    finally:
        lk.close()


def test_without_the_wait_a_local_hit_waits_for_a_later_pass():
    """The control: ``local_hit_wait_ms = 0`` leaves the claims to arrive after
    ``prepare_request`` returned (the owner thread is held meanwhile)."""
    pool = make_pool()
    lk = make_linker(pool, local_hit_wait_ms=0)
    try:
        hashes = _stored(lk, pool, 2, "no-wait")
        gate = threading.Event()
        lk._adapter._inbox.put(_call_blocking_on(gate))
        handle = lk.prepare_request(LinkerRequestContext("r"), kv_transfer(hashes))
        assert lk.preparation_ready(handle) is False
        gate.set()
        wait_until(lambda: lk.preparation_ready(handle), what="claims")
        assert lk.lookup("r", kv_transfer(hashes)) == [1, 2]
    finally:
        lk.close()


def test_a_slow_owner_thread_bounds_the_wait_and_the_request_goes_on_later():
    pool = make_pool()
    lk = make_linker(pool, local_hit_wait_ms=20)
    try:
        hashes = _stored(lk, pool, 2, "slow-owner")
        lk.num_completed_offloads()
        gate = threading.Event()
        lk._adapter._inbox.put(_call_blocking_on(gate))
        handle = lk.prepare_request(LinkerRequestContext("r"), kv_transfer(hashes))
        assert lk.preparation_ready(handle) is False
        assert lk.stats.local_hit_waits_expired == 1
        # The step's budget is spent: the next local hit of this step waits no more.
        started = time.monotonic()
        other = lk.prepare_request(LinkerRequestContext("o"), kv_transfer(hashes))
        assert time.monotonic() - started < 0.015
        assert lk.preparation_ready(other) is False
        assert lk.stats.local_hit_waits_expired == 1  # it never waited
        gate.set()
        wait_until(lambda: lk.preparation_ready(handle), what="claims")
        assert lk.lookup("r", kv_transfer(hashes)) == [1, 2]
    finally:
        lk.close()


def _call_blocking_on(gate: threading.Event):
    """An owner-thread command that holds the thread until ``gate`` is set."""
    from concurrent.futures import Future

    from sglang.srt.mem_cache.storage.kvcr.owner.owner_inbox import Call

    return Call(lambda kv: gate.wait(10), Future())


def test_a_cold_tail_check_drains_pages_that_just_arrived():
    """``tail_may_hit`` (the enqueue-time skip of cold tails) drains KVCR's
    queued results before it calls a page absent, as ``prepare_request`` does:
    a page whose arrival is queued but not yet drained still starts a hit."""
    pool = make_pool()
    fill_random(pool, [1], seed=19)
    lk = make_linker(pool)
    try:
        hashes = hashes_for(1, "just-arrived")
        assert lk.offload(kv_transfer(hashes, [1])) is True
        lk.num_completed_offloads()  # the pump submits the deposit
        # The owner published the page and answered the deposit; nobody drained.
        wait_until(lambda: lk._adapter._results.qsize() >= 2, what="results queued")
        assert not lk.residency.holds(hashes[0], lk.layout.full_pools)
        assert lk.tail_may_hit("r", hashes[0]) is True
        assert lk.stats.prepare_skipped == 0
        assert lk.tail_may_hit("r", hashes_for(1, "never-stored")[0]) is False
        assert lk.stats.prepare_skipped == 1
    finally:
        lk.close()
