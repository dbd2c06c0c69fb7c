"""KVCRDirectLinker over real kvcr 0.1.1 + NIXL and a real CPU MHATokenToKVPool."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from cpu_harness import kvcr_pages as pages
from cpu_harness.kvcr_pages import (
    LAYERS,
    PAGE,
    hashes_for,
    kv_transfer,
    make_linker,
    make_pool,
    offload_and_commit,
    owner_stalled,
    page_bytes,
    prepare,
    restore,
    wait_until,
)
from cpu_harness.kvcr_pages import fill_random as fill_pages
from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRConfigError
from sglang.srt.mem_cache.storage.kvcr.requests.fetch_plan import PoolFetch
from sglang.srt.mem_cache.storage.kvcr.requests.preparation import FetchOwner
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
)

pytestmark = pytest.mark.kvcr

HEADS, DIM = pages.HEADS, pages.DIM


def page_hashes(n, salt="a"):
    return hashes_for(n, salt)


def test_offload_then_restore_into_other_slots_is_byte_exact(pool, linker):
    """Pages round-trip device -> KVCR DRAM -> other device slots bit for bit."""
    fill_pages(pool, [1, 2, 3], seed=1)
    hashes = page_hashes(3)
    originals = [page_bytes(pool, p).clone() for p in (1, 2, 3)]
    untouched = page_bytes(pool, 20).clone()
    assert offload_and_commit(linker, hashes, [1, 2, 3]) is True
    fill_pages(pool, [1, 2, 3], seed=2)  # the device copy is gone

    prepare(linker, "r1", hashes)
    assert restore(linker, "r1", hashes, [10, 11, 12]) is True
    for original, page in zip(originals, (10, 11, 12)):
        assert torch.equal(page_bytes(pool, page), original)
    assert torch.equal(page_bytes(pool, 20), untouched)
    assert linker.claims_held() == 0


def test_gpu_restore_branch_gathers_byte_exact_on_cpu(pool, linker):
    """The GPU restore branch (slot-run spans through a scratch buffer, scattered
    into the pool rows), driven through the linker with its CPU variant: bytes
    land exactly."""
    from sglang.srt.mem_cache.storage.kvcr.datapath.span_restore import SpanRestore

    linker.restorer.span_restore = span = SpanRestore(torch.device("cpu"))
    fill_pages(pool, [1, 2, 3], seed=31)
    hashes = page_hashes(3, "gpu-branch")
    originals = [page_bytes(pool, p).clone() for p in (1, 2, 3)]
    untouched = page_bytes(pool, 25).clone()
    assert offload_and_commit(linker, hashes, [1, 2, 3]) is True
    prepare(linker, "g", hashes)
    assert restore(linker, "g", hashes, [21, 23, 22]) is True
    for original, page in zip(originals, (21, 23, 22), strict=True):
        assert torch.equal(page_bytes(pool, page), original)
    assert torch.equal(page_bytes(pool, 25), untouched)
    assert span.span_copies >= 1


def test_lookup_reports_only_claimed_prefix_and_follows_the_device_prefix(pool, linker):
    """Absent pages end the hit; a lookup after the device prefix moved maps into it."""
    fill_pages(pool, [1, 2], seed=3)
    hashes = page_hashes(4)
    assert offload_and_commit(linker, hashes[:2], [1, 2]) is True
    handle = linker.prepare_request(LinkerRequestContext("r2"), kv_transfer(hashes))
    wait_until(lambda: linker.preparation_ready(handle), what="preparation")
    assert linker.lookup("r2", kv_transfer(hashes)) == [1, 2]
    # The device now holds page 0: the tail starts at page 1.
    assert linker.lookup("r2", kv_transfer(hashes[1:])) == [1]
    # An unrelated tail retires the preparation and releases its claims.
    assert linker.lookup("r2", kv_transfer(page_hashes(2, salt="z"))) == []
    assert linker.claims_held() == 0


def test_zero_hit_request_is_ready_without_an_owner_round_trip(pool, linker):
    """No residents and no hint: ready at once, no KVCR fetch issued."""
    before = linker._adapter.stats().fetches
    handle = linker.prepare_request(
        LinkerRequestContext("z"), kv_transfer(page_hashes(8, "q"))
    )
    assert linker.preparation_ready(handle) is True
    assert linker.lookup("z", kv_transfer(page_hashes(8, "q"))) == []
    assert linker._adapter.stats().fetches == before


def test_abort_during_preparation_releases_every_claim(pool, linker):
    """release_request drops the claims; KVCR reports none held afterwards."""
    fill_pages(pool, [1, 2, 3], seed=4)
    hashes = page_hashes(3, "ab")
    assert offload_and_commit(linker, hashes, [1, 2, 3]) is True
    handle = linker.prepare_request(LinkerRequestContext("ab"), kv_transfer(hashes))
    wait_until(lambda: linker.preparation_ready(handle), what="preparation")
    assert linker.claims_held() == 3
    released_before = linker._adapter.stats().claims_released
    linker.release_request("ab")
    assert linker.claims_held() == 0
    wait_until(
        lambda: linker._adapter.stats().claims_released - released_before == 3,
        what="claims released in KVCR",
    )
    # The pages are still resident, but an unprepared lookup is a miss at once
    # (it never waits on the scheduler thread); a new preparation hits.
    started = time.monotonic()
    assert linker.lookup("ab", kv_transfer(hashes)) == []
    assert time.monotonic() - started < 0.1
    assert linker.stats.miss_unprepared == 1 and linker.claims_held() == 0
    prepare(linker, "ab", hashes)
    assert linker.claims_held() == 3
    linker.finish_request("ab")
    assert linker.claims_held() == 0


def test_hinted_peer_pages_are_fetched_and_hint_alone_never_hits():
    """B fetches A's pages named by a kv.fetch hint; pages A lacks never hit."""
    pool_a, pool_b = make_pool(), make_pool()
    a = make_linker(pool_a)
    b = make_linker(pool_b)
    try:
        fill_pages(pool_a, [1, 2], seed=5)
        hashes = page_hashes(4, "peer")
        assert offload_and_commit(a, hashes[:2], [1, 2]) is True
        from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import (
            page_hash_to_u64,
        )

        hint = {
            "protocol_version": "1.0",
            "message_id": "m1",
            "actions": [
                {
                    "action_id": "x",
                    "action_type": "kv.fetch",
                    "action_version": "1.0",
                    "payload": {
                        "source_control_endpoint": a.endpoint,
                        "block_hashes": [page_hash_to_u64(h) for h in hashes],
                    },
                }
            ],
        }
        # A keeps serving from its owner thread while only B is driven here.
        handle = b.prepare_request(
            LinkerRequestContext("p", 0, hint), kv_transfer(hashes)
        )
        wait_until(lambda: b.preparation_ready(handle), timeout=15, what="peer prepare")
        assert b.lookup("p", kv_transfer(hashes)) == [1, 2]
        assert restore(b, "p", hashes[:2], [30, 31]) is True
        assert torch.equal(page_bytes(pool_b, 30), page_bytes(pool_a, 1))
        assert torch.equal(page_bytes(pool_b, 31), page_bytes(pool_a, 2))
        # A hint with no resident source pages never produces a hit.
        missing = page_hashes(2, "nobody")
        hint2 = {
            **hint,
            "actions": [
                {
                    **hint["actions"][0],
                    "payload": {
                        "source_control_endpoint": a.endpoint,
                        "block_hashes": [page_hash_to_u64(h) for h in missing],
                    },
                }
            ],
        }
        handle = b.prepare_request(
            LinkerRequestContext("q", 0, hint2), kv_transfer(missing)
        )
        wait_until(
            lambda: b.preparation_ready(handle), timeout=15, what="stale prepare"
        )
        assert b.lookup("q", kv_transfer(missing)) == []
    finally:
        b.close()
        a.close()


def test_offload_results_stay_positional_when_refused(pool):
    """Offloads over the byte budget are still accepted and fail in FIFO order; one
    larger than the whole budget runs when nothing else is in flight."""
    lk = make_linker(pool, max_inflight_offload_bytes=1)
    try:
        fill_pages(pool, [1, 2], seed=6)
        assert lk.offload(kv_transfer(page_hashes(1, "f"), [1])) is True
        assert lk.offload(kv_transfer(page_hashes(1, "g"), [2])) is True
        assert lk.offload(kv_transfer([], [])) is True
        wait_until(lambda: lk.num_completed_offloads() == 3, what="three results")
        results = [lk.pop_completed_offload() for _ in range(3)]
        # The first runs alone; the second arrives while it is in flight.
        assert results == [True, False, False]
        assert lk._adapter.stats().refused_offload == 1
    finally:
        lk.close()


def test_split_offload_has_one_fifo_result_and_restores_every_page(pool, monkeypatch):
    """A large offload goes to KVCR as several deposits but stays one FIFO result."""
    from sglang.srt.mem_cache.storage.kvcr.datapath import offload_queue

    monkeypatch.setattr(offload_queue, "SPLIT_DEPOSIT_BYTES", 0)
    lk = make_linker(pool)
    try:
        fill_pages(pool, [1, 2, 3], seed=21)
        originals = [page_bytes(pool, p).clone() for p in (1, 2, 3)]
        hashes = page_hashes(3, "split")
        before = lk._adapter.stats().deposits
        assert offload_and_commit(lk, hashes, [1, 2, 3]) is True
        assert lk.num_completed_offloads() == 0
        parts = min(offload_queue.DEPOSIT_PARTS, 3)
        assert parts > 1
        assert lk._adapter.stats().deposits - before == parts
        prepare(lk, "sp", hashes)
        assert restore(lk, "sp", hashes, [30, 31, 32]) is True
        for original, page in zip(originals, (30, 31, 32), strict=True):
            assert torch.equal(page_bytes(pool, page), original)
    finally:
        lk.close()


def test_split_offload_is_admitted_or_refused_as_a_whole(pool, monkeypatch):
    """The deposits of one split offload share one budget charge: refused together
    while other work is in flight (no half lands in KVCR), admitted together when
    alone even above the budget."""
    from sglang.srt.mem_cache.storage.kvcr.datapath import offload_queue

    monkeypatch.setattr(offload_queue, "SPLIT_DEPOSIT_BYTES", 0)
    page_total = LAYERS * 2 * PAGE * HEADS * DIM * 2
    lk = make_linker(pool, max_inflight_offload_bytes=2 * page_total)
    try:
        fill_pages(pool, [1, 2, 3, 4, 5], seed=22)
        big = page_hashes(4, "half")
        assert lk.offload(kv_transfer(page_hashes(1, "first"), [5])) is True
        assert lk.offload(kv_transfer(big, [1, 2, 3, 4])) is True
        wait_until(lambda: lk.num_completed_offloads() == 2, what="two results")
        assert [lk.pop_completed_offload(), lk.pop_completed_offload()] == [True, False]
        assert lk._adapter.stats().refused_offload == 1
        assert not any(
            lk.layout.block_key(h, "kv") in lk.residency for h in big
        )  # neither half was written
        # Alone, the same 4-page offload (twice the budget) is admitted whole.
        assert offload_and_commit(lk, big, [1, 2, 3, 4]) is True
        wait_until(
            lambda: lk.num_completed_offloads() == 0
            and all(lk.layout.block_key(h, "kv") in lk.residency for h in big),
            what="residency mirror",
        )
    finally:
        lk.close()


def test_missing_claim_at_load_fails_the_batch_instead_of_loading_wrong_kv(
    pool, linker
):
    """load() without held claims still queues (rank-deterministic) but finishes False."""
    hashes = page_hashes(2, "nl")
    before = page_bytes(pool, 40).clone()
    assert restore(linker, "nl", hashes, [40, 41]) is False
    assert torch.equal(page_bytes(pool, 40), before)


def test_reset_clears_residency_and_rebuilds_kvcr(pool, linker):
    """After reset (flush) earlier pages are a clean miss."""
    fill_pages(pool, [1], seed=7)
    hashes = page_hashes(1, "rs")
    assert offload_and_commit(linker, hashes, [1]) is True
    linker.reset()
    handle = linker.prepare_request(LinkerRequestContext("rs"), kv_transfer(hashes))
    assert linker.preparation_ready(handle) is True
    assert linker.lookup("rs", kv_transfer(hashes)) == []


def test_kvcr_eviction_reports_removed_page_hashes(pool):
    """Capacity eviction surfaces through take_removed_page_hashes."""
    lk = make_linker(
        pool, local_dram_bytes_per_worker=4 * LAYERS * 2 * PAGE * HEADS * DIM * 2
    )
    try:
        fill_pages(pool, list(range(1, 7)), seed=8)
        hashes = page_hashes(6, "ev")
        for h, p in zip(hashes, range(1, 7)):
            assert offload_and_commit(lk, [h], [p]) is True
        removed = lk.take_removed_page_hashes()
        assert set(removed) == set(hashes[:2])
        assert lk.take_removed_page_hashes() == []
    finally:
        lk.close()


def test_restore_copy_and_kvcr_calls_stay_off_the_scheduler_thread(pool, linker):
    """The loader thread copies; the owner thread talks to KVCR; never the caller."""
    calls = []
    kv = linker._adapter.call(lambda kv: kv)
    local = kv._core._local_dram  # a deposit allocates its slots here
    original = local._allocate_slots

    def spy(*a, **k):
        calls.append(threading.current_thread().name)
        return original(*a, **k)

    local._allocate_slots = spy
    fill_pages(pool, [1], seed=9)
    assert offload_and_commit(linker, page_hashes(1, "th"), [1]) is True
    assert calls == [linker._adapter.owner_thread.name]


def test_bad_linker_config_is_refused_before_kvcr_starts(pool):
    """A config error names the field; no KVCR is constructed."""
    with pytest.raises(KVCRConfigError, match="local_dram_bytes_per_worker"):
        make_linker(pool, local_dram_bytes_per_worker=0)


def test_abandoned_fetch_bytes_bound_refuses_new_preparations(pool):
    """Fetches of dropped requests count as abandoned; over the bound, preparing stops."""
    lk = make_linker(pool, max_abandoned_bytes=1)
    gate = threading.Event()
    try:
        fill_pages(pool, [1, 2], seed=10)
        hashes = page_hashes(2, "abd")
        assert offload_and_commit(lk, hashes, [1, 2]) is True
        # Hold the owner thread so the fetch stays unresolved while we drop it.
        blocker = threading.Thread(
            target=lambda: lk._adapter.call(lambda kv: gate.wait(10), timeout_s=15)
        )
        blocker.start()
        lk.prepare_request(LinkerRequestContext("gone"), kv_transfer(hashes))
        lk.release_request("gone")
        assert lk.abandoned_bytes() > 1
        handle = lk.prepare_request(LinkerRequestContext("next"), kv_transfer(hashes))
        assert lk.preparation_ready(handle) is True
        assert lk.stats.refused_abandoned == 1
        gate.set()
        blocker.join(15)
        # Once KVCR answers, the late claims are released and the bound clears.
        wait_until(lambda: (lk._pump(), lk.abandoned_bytes() == 0)[1], what="drain")
        assert lk.claims_held() == 0
        prepare(lk, "again", hashes)
    finally:
        gate.set()
        lk.close()


def test_releasing_a_request_with_a_queued_load_releases_its_claims(pool, linker):
    """A queued (not started) load holds claims; ending the request frees them."""
    fill_pages(pool, [1, 2], seed=13)
    hashes = page_hashes(2, "queued")
    assert offload_and_commit(linker, hashes, [1, 2]) is True
    prepare(linker, "q", hashes)
    assert linker.load("q", kv_transfer(hashes, [40, 41])) is True
    before = linker._adapter.stats().claims_released
    linker.release_request("q")
    wait_until(
        lambda: linker._adapter.stats().claims_released - before == 2,
        what="claims released",
    )
    assert linker.start_layer_wise_loading() == -1  # nothing left to load


def test_reset_forgets_what_the_old_core_owed(pool):
    """Fetches abandoned on a core that reset replaced never complete: a flush must
    not leave their bytes counted, or every later preparation would be refused."""
    lk = make_linker(pool, max_abandoned_bytes=1)
    try:
        fill_pages(pool, [1, 2], seed=12)
        hashes = page_hashes(2, "owed")
        assert offload_and_commit(lk, hashes, [1, 2]) is True
        # An op of the old core, never to complete.
        lk.preparations.abandon(
            10**9, FetchOwner("gone", 1 << 20, PoolFetch((), (), 0, moved=True))
        )
        assert lk.abandoned_bytes() > 1
        lk.reset()
        assert lk.abandoned_bytes() == 0
        assert offload_and_commit(lk, hashes, [1, 2]) is True
        prepare(lk, "after", hashes)
        assert lk.stats.refused_abandoned == 0
    finally:
        lk.close()


def test_sidecar_draft_pool_pages_round_trip_with_the_target_pages(pool):
    """A draft KV pool sharing the target's slots is offloaded and restored too."""
    draft = make_pool()
    lk = make_linker(pool, draft_pools=(draft,))
    try:
        assert [p.name for p in lk.layout.pools] == ["kv", "draft"]
        fill_pages(pool, [1, 2], seed=11)
        fill_pages(draft, [1, 2], seed=12)
        want = [
            (page_bytes(pool, p).clone(), page_bytes(draft, p).clone()) for p in (1, 2)
        ]
        hashes = page_hashes(2, "dr")
        assert offload_and_commit(lk, hashes, [1, 2]) is True
        prepare(lk, "dr", hashes)
        assert restore(lk, "dr", hashes, [7, 8]) is True
        for (kv_bytes, draft_bytes), page in zip(want, (7, 8)):
            assert torch.equal(page_bytes(pool, page), kv_bytes)
            assert torch.equal(page_bytes(draft, page), draft_bytes)
    finally:
        lk.close()


def test_more_than_one_draft_pool_is_refused_at_startup(pool):
    """Two draft pools cannot be described: a clear startup error, no KVCR."""
    with pytest.raises(ValueError, match="at most one draft KV pool"):
        make_linker(pool, draft_pools=(make_pool(), make_pool()))


def test_staged_offload_round_trip_is_byte_exact_and_returns_its_slots(pool):
    """offload_path=staged copies pages to host staging, deposits, frees the slots."""
    lk = make_linker(pool, offload_path="staged")
    try:
        assert lk.offloader.staging is not None
        free_before = lk.offloader.staging.free_slots
        fill_pages(pool, [1, 2, 3], seed=13)
        want = [page_bytes(pool, p).clone() for p in (1, 2, 3)]
        hashes = page_hashes(3, "st")
        assert offload_and_commit(lk, hashes, [1, 2, 3]) is True
        assert lk.offloader.staging.free_slots == free_before
        fill_pages(pool, [1, 2, 3], seed=14)
        handle = lk.prepare_request(LinkerRequestContext("st"), kv_transfer(hashes))
        wait_until(lambda: lk.preparation_ready(handle), what="prepare")
        assert restore(lk, "st", hashes, [20, 21, 22]) is True
        for original, page in zip(want, (20, 21, 22)):
            assert torch.equal(page_bytes(pool, page), original)
    finally:
        lk.close()


def test_full_staging_area_fails_the_offload_in_fifo_order(pool):
    """No free staging slots: the offload is accepted and completes False, in order."""
    page_total = LAYERS * 2 * PAGE * HEADS * DIM * 2
    lk = make_linker(pool, offload_path="staged", max_inflight_offload_bytes=page_total)
    try:
        assert lk.offloader.staging.pages == 1
        fill_pages(pool, [1, 2], seed=15)
        assert lk.offload(kv_transfer(page_hashes(2, "big"), [1, 2])) is True
        assert lk.offload(kv_transfer(page_hashes(1, "ok"), [1])) is True
        wait_until(lambda: lk.num_completed_offloads() == 2, what="both results")
        assert [lk.pop_completed_offload(), lk.pop_completed_offload()] == [False, True]
        assert lk.stats.offload_staging_full == 1
    finally:
        lk.close()


def test_a_stale_attempt_never_satisfies_a_newer_one(pool, linker):
    """Attempt 0's late fetch results are released, never credited to attempt 1."""
    fill_pages(pool, [1, 2], seed=16)
    old, new = page_hashes(2, "old"), page_hashes(2, "new")
    assert offload_and_commit(linker, old, [1, 2]) is True
    with owner_stalled(linker):
        linker.prepare_request(LinkerRequestContext("r", 0), kv_transfer(old))
        h1 = linker.prepare_request(LinkerRequestContext("r", 1), kv_transfer(new))
    wait_until(lambda: linker.preparation_ready(h1), what="attempt 1 ready")
    wait_until(
        lambda: (linker._pump(), linker.stats.late_claims_released == 2)[1],
        what="attempt 0 claims released",
    )
    assert linker.lookup("r", kv_transfer(old)) == []
    assert linker.claims_held() == 0


def test_a_failed_restore_copy_fails_the_batch_and_stops_new_restores(pool, linker):
    """A copy error fails the counter (finish False), releases claims, disables hits."""
    fill_pages(pool, [1, 2], seed=17)
    hashes = page_hashes(2, "cf")
    assert offload_and_commit(linker, hashes, [1, 2]) is True
    prepare(linker, "cf", hashes)

    def broken(*args):
        raise RuntimeError("injected copy failure at layer 1")

    linker.restorer.copy_batch = (
        broken  # a device copy cannot be made to fail for real here
    )
    released = linker._adapter.stats().claims_released
    assert restore(linker, "cf", hashes, [30, 31]) is False
    wait_until(
        lambda: linker._adapter.stats().claims_released - released == 2,
        what="claims released after the failed restore",
    )
    handle = linker.prepare_request(LinkerRequestContext("cf2"), kv_transfer(hashes))
    wait_until(lambda: linker.preparation_ready(handle), what="prepare")
    assert linker.lookup("cf2", kv_transfer(hashes)) == []
    assert linker.stats.miss_restore_disabled == 1
    linker.release_request("cf2")


def test_unquiescent_core_at_reset_keeps_its_dram_quarantined(pool, linker):
    """If KVCR cannot prove quiescence, its DRAM is never reused by the new core."""
    old = dict(linker.dram.storage)
    real_close = linker._adapter.close

    def unquiescent_close(timeout_s=None):
        real_close(timeout_s)
        return False  # what a dead peer's quarantined operation makes close() report

    linker._adapter.close = unquiescent_close
    linker.reset()
    assert linker.quarantined_bytes() == sum(t.numel() for t in old.values())
    for name, tensor in old.items():
        assert linker.dram.storage[name].data_ptr() != tensor.data_ptr()
    assert "quarantined_bytes=" in linker.stats_line()
    # The new core works on its fresh DRAM.
    fill_pages(pool, [3], seed=18)
    assert offload_and_commit(linker, page_hashes(1, "q"), [3]) is True


@pytest.mark.parametrize(
    ("field", "flag"),
    [
        ("pp_size", "--pp-size"),
        ("dcp_size", "--dcp-size"),
        ("attn_cp_size", "--attn-cp-size"),
    ],
    ids=["pp", "dcp", "cp"],
)
def test_unsupported_parallel_layouts_are_refused_naming_the_flag(pool, field, flag):
    """PP > 1 and token-splitting context parallelism fail at startup, flag named."""
    from sglang.srt.mem_cache.storage.kvcr.config.startup_checks import (
        refuse_unsupported_topology,
    )

    with pytest.raises(KVCRConfigError, match=flag):
        refuse_unsupported_topology(SimpleNamespace(**{field: 2}))
    refuse_unsupported_topology(SimpleNamespace(**{field: 1}))


@pytest.mark.parametrize("where", ["metrics", "restorer"])
def test_a_start_up_failure_gives_back_what_it_took(where, monkeypatch):
    """A failure while the linker is built (registering its metrics, before
    KVCR starts; starting the restorer, after) reaches the caller unchanged and
    leaves nothing behind: the DRAM share is unlocked, a started KVCR is closed,
    and no thread of the linker outlives the constructor."""
    from sglang.srt.mem_cache.storage.kvcr import kvcr_direct_linker
    from sglang.srt.mem_cache.storage.kvcr.device.host_memory import HostMemory
    from sglang.srt.mem_cache.storage.kvcr.observability import linker_metrics
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_adapter import KVCRAdapter

    calls = []

    def spy(cls, name):
        real = getattr(cls, name)

        def wrapped(self, *args, **kwargs):
            calls.append(name)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapped)

    def fail(*_args, **_kwargs):
        raise RuntimeError("start-up failed here")

    spy(HostMemory, "release_all")
    spy(KVCRAdapter, "close")
    site = linker_metrics if where == "metrics" else kvcr_direct_linker
    monkeypatch.setattr(site, "build" if where == "metrics" else "Restorer", fail)
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="start-up failed here"):
        pages.make_linker(pages.make_pool("cpu"))
    assert calls == (["release_all"] if where == "metrics" else ["close"])
    wait_until(
        lambda: not [t for t in threading.enumerate() if t not in before],
        what="the linker's threads stopped",
    )


def test_the_dynamic_loader_without_the_plugin_gets_one_clear_error():
    """SGLang's dynamic loader calls the class with its own arguments when the
    plugin's linker hook did not run (SGLANG_PLUGINS leaving kvcr out): the
    error names the plugin, the variable and the flag instead of a TypeError."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRUnavailableError
    from sglang.srt.mem_cache.storage.kvcr.kvcr_direct_linker import KVCRDirectLinker

    with pytest.raises(KVCRUnavailableError) as err:
        KVCRDirectLinker(
            SimpleNamespace(),
            SimpleNamespace(page_size=16),
            components={0},
            extra_config={"local_dram_bytes_per_worker": 1 << 20},
            forward_stream=None,
        )
    message = str(err.value)
    assert "SGLANG_PLUGINS" in message and "builder.build_linker" in message
    assert "--unified-cache-external-linker-backend kvcr" in message
