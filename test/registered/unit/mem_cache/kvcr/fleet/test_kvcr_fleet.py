"""Fleet correctness: no request fails or waits for another's sake, stale state
never decides, and a worker stuck with quarantined DRAM stops growing it.

One restore verdict per request (a request whose claims went missing is aborted
alone, the rest of its batch runs on restored KV); a failed copy pauses restores
for a while instead of for the process's life; resident pages are claimed without
charging the preparation budget, and a hint whose fetch was refused rides on the
next; a stale preparation handle never reads a newer attempt; the PD requeue
prepares the request it was given; a page evicted from any of its KVCR pools
clears its stored mark; a hint naming the worker itself is served from local
residency; past ``max_quarantined_cores`` peer fetches stop.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from cpu_harness.kvcr_pages import (
    PAGE_BYTES,
    fetch_hint,
    fill_random,
    hashes_for,
    kv_transfer,
    make_linker,
    make_pool,
    offload_and_commit,
    page_bytes,
    prepare,
    stall_owner,
    wait_until,
    wrong_bytes,
)
from sglang.srt.mem_cache.storage.kvcr.datapath import restore as restore_mod
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import InventoryChange
from sglang.srt.mem_cache.storage.kvcr.owner.quarantine import RetainedCore
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import integration
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
    PreparationHandle,
)

pytestmark = pytest.mark.kvcr


class _Wrapper:
    """What ``UnifiedCacheLinkerWrapper.finish_loads`` reads and writes."""

    def __init__(self, linker, rids, index):
        self.cache_linker = linker
        self.inflight_load_rids = list(rids)
        self.inflight_load_index = index
        self.private_load_indices = {rid: object() for rid in rids}
        self.reduced = []
        # Two attention ranks (what SGLang's reduction reads), this one's end.
        self.cache = SimpleNamespace(
            _all_reduce_attn_groups=lambda t, op: self.reduced.append(t.tolist()),
            attn_cp_group=None,
            attn_tp_group=None,
            tp_group=None,
            tp_world_size=2,
        )


def test_a_request_whose_claims_went_missing_is_aborted_alone(pool, linker):
    """Two loads in one batch, one of them without its claims: only that request
    is reported failed; the other's KV lands bit-exact and it runs."""
    fill_random(pool, [1, 2, 3, 4], seed=21)
    want = [page_bytes(pool, p) for p in (1, 2)]
    good, bad = hashes_for(2, "good"), hashes_for(2, "bad")
    assert offload_and_commit(linker, good, [1, 2], "cpu") is True
    assert offload_and_commit(linker, bad, [3, 4], "cpu") is True
    prepare(linker, "good", good)
    prepare(linker, "bad", bad)
    linker.preparations.get("bad").landed.pop(1)  # one claim gone (e.g. a failed fetch)
    assert linker.load("good", kv_transfer(good, [20, 21])) is True
    assert linker.load("bad", kv_transfer(bad, [22, 23])) is True
    index = linker.start_layer_wise_loading()
    wrapper = _Wrapper(linker, ["good", "bad"], index)
    failed = integration._around_finish_loads(
        lambda w: pytest.fail("the batch-wide verdict ran"), wrapper
    )
    assert failed == ["bad"]
    assert wrapper.reduced == [[2, -2], [1, 0]]  # the count, then one flag each
    assert wrapper.private_load_indices == {} and wrapper.inflight_load_rids == []
    assert wrong_bytes(pool, [20, 21], want) == 0
    wait_until(lambda: linker.claims_held() == 0, what="claims released")


def test_linkers_without_per_request_verdicts_keep_the_batch_verdict():
    calls = []
    wrapper = SimpleNamespace(cache_linker=object())
    out = integration._around_finish_loads(lambda w: calls.append(w) or ["x"], wrapper)
    assert out == ["x"] and calls == [wrapper]


def test_a_failed_copy_pauses_restores_then_they_resume(pool, linker, monkeypatch):
    """A copy error fails its batch and pauses restores; once the pause is over,
    a fresh batch restores normally (not disabled for the process's life)."""
    monkeypatch.setattr(restore_mod, "RESTORE_PAUSE_S", 0.3)
    fill_random(pool, [1, 2], seed=17)
    want = [page_bytes(pool, p) for p in (1, 2)]
    hashes = hashes_for(2, "cf")
    assert offload_and_commit(linker, hashes, [1, 2], "cpu") is True
    prepare(linker, "cf", hashes)
    real = linker.restorer.copy_batch

    def broken(*args):
        raise RuntimeError("injected copy failure")

    linker.restorer.copy_batch = broken  # a device copy cannot be made to fail for real
    assert linker.load("cf", kv_transfer(hashes, [30, 31])) is True
    assert linker.finish_layer_wise_loading(linker.start_layer_wise_loading()) is False
    assert linker.stats.restore_copy_failures == 1
    linker.restorer.copy_batch = real
    handle = linker.prepare_request(LinkerRequestContext("cf2"), kv_transfer(hashes))
    wait_until(lambda: linker.preparation_ready(handle), what="prepared")
    assert linker.lookup("cf2", kv_transfer(hashes)) == []  # paused
    assert linker.stats.miss_restore_disabled == 1
    linker.release_request("cf2")
    wait_until(
        lambda: linker.lookup("probe", kv_transfer(hashes)) == []
        and linker.stats.miss_unprepared > 0,
        what="the pause to end",
    )
    prepare(linker, "cf3", hashes)
    assert linker.load("cf3", kv_transfer(hashes, [40, 41])) is True
    assert linker.finish_layer_wise_loading(linker.start_layer_wise_loading()) is True
    assert wrong_bytes(pool, [40, 41], want) == 0


def test_a_stale_handle_never_reads_a_newer_attempts_readiness(pool, linker):
    """Attempt 1 is still fetching: attempt 0's handle is not held back by it,
    attempt 1's is; a handle is a typed value, not a string to split."""
    fill_random(pool, [1, 2], seed=3)
    hashes = hashes_for(2, "att")
    assert offload_and_commit(linker, hashes, [1, 2], "cpu") is True
    release = stall_owner(linker)
    try:
        old = linker.prepare_request(LinkerRequestContext("r", 0), kv_transfer(hashes))
        new = linker.prepare_request(LinkerRequestContext("r", 1), kv_transfer(hashes))
        assert old == PreparationHandle("r", 0) and str(new) == "r#1"
        assert linker.preparation_ready(new) is False
        assert linker.preparation_ready(old) is True
    finally:
        release()
    wait_until(lambda: linker.preparation_ready(new), what="attempt 1 prepared")
    linker.release_request("r")


def test_pd_requeue_prepares_the_request_it_was_given():
    """``optimistic_release_and_requeue(req)`` may put ``req`` anywhere in the
    queue: the hook prepares that request, not whichever is first."""
    first, requeued = SimpleNamespace(rid="first"), SimpleNamespace(rid="again")
    scheduler = SimpleNamespace(tree_cache=object(), waiting_queue=[first, requeued])
    with (
        mock.patch.object(integration, "preparing_linker_of", return_value=object()),
        mock.patch.object(integration, "_prepare_safely") as prep,
    ):
        integration._after_optimistic_requeue(None, scheduler, requeued)
        integration._after_optimistic_requeue(None, scheduler, req=requeued)
    assert [c.args[1] for c in prep.call_args_list] == [requeued, requeued]


def test_a_page_evicted_from_any_pool_is_reported_removed(pool):
    """The stored mark of a page must clear when KVCR evicts its object from any
    pool (here the draft pool), not only from the first one; each page once."""
    lk = make_linker(pool, draft_pools=(make_pool("cpu"),))
    try:
        kv, draft = (p.name for p in lk.layout.pools)
        hashes = hashes_for(3, "ev")
        keys = (
            lk.layout.block_key(hashes[0], kv),
            lk.layout.block_key(hashes[1], draft),  # only the draft object
            lk.layout.block_key(hashes[2], draft),
            lk.layout.block_key(hashes[2], kv),
            b"not-one-of-ours",
        )
        lk.stats.evicted_pages += lk.residency.on_inventory(
            InventoryChange(keys=keys, removed=True)
        )
        assert lk.take_removed_page_hashes() == sorted(hashes)
        assert lk.stats.evicted_pages == 3
    finally:
        lk.close()


def test_a_hint_naming_this_worker_is_served_from_local_residency(pool, linker):
    """A router that names the worker itself: no NIXL transfer to itself (KVCR
    would log ``remote agent name same as local agent`` per request); resident
    pages restore, the others are a plain miss, and the case is counted."""
    fill_random(pool, [1, 2], seed=8)
    want = [page_bytes(pool, p) for p in (1, 2)]
    hashes = hashes_for(3, "self")
    assert offload_and_commit(linker, hashes[:2], [1, 2], "cpu") is True
    fetches = linker._adapter.stats().fetches
    handle = linker.prepare_request(
        LinkerRequestContext("s", 0, fetch_hint(linker.endpoint, hashes)),
        kv_transfer(hashes),
    )
    wait_until(lambda: linker.preparation_ready(handle), what="prepared")
    assert linker.stats.hints_self == 1
    assert linker._adapter.stats().fetches - fetches == 1  # local pages only
    assert linker.lookup("s", kv_transfer(hashes)) == [1, 2]
    assert linker.load("s", kv_transfer(hashes[:2], [10, 11])) is True
    assert linker.finish_layer_wise_loading(linker.start_layer_wise_loading())
    assert wrong_bytes(pool, [10, 11], want) == 0
    assert torch.equal(page_bytes(pool, 10), want[0])


def test_a_burst_of_resident_arrivals_all_restore_within_a_small_budget(pool):
    """Local residency claims move no bytes, so they are not charged: eight
    requests arriving together, each larger than the whole preparation budget
    (the default 512 MiB against 329 MiB per 3000-token Qwen3-0.6B request is
    the same shape), are all prepared and all restore."""
    pages, n = 4, 8
    lk = make_linker(pool, max_inflight_prepare_bytes=3 * PAGE_BYTES)  # < 1 request
    try:
        prompts = [hashes_for(pages, f"burst{i}") for i in range(n)]
        fill_random(pool, list(range(1, 1 + pages * n)), seed=30)
        want = [page_bytes(pool, p) for p in range(1, 1 + pages * n)]
        for i, hashes in enumerate(prompts):
            src = list(range(1 + i * pages, 1 + (i + 1) * pages))
            assert offload_and_commit(lk, hashes, src, "cpu") is True
        handles = [
            lk.prepare_request(LinkerRequestContext(f"b{i}"), kv_transfer(h))
            for i, h in enumerate(prompts)  # all submitted before any completes
        ]
        for handle in handles:
            wait_until(lambda h=handle: lk.preparation_ready(h), what="burst ready")
        assert lk._adapter.stats().refused_prepare == 0
        for i, hashes in enumerate(prompts):
            assert lk.lookup(f"b{i}", kv_transfer(hashes)) == list(range(1, pages + 1))
            dest = list(range(40, 40 + pages))
            assert lk.load(f"b{i}", kv_transfer(hashes, dest)) is True
            assert lk.finish_layer_wise_loading(lk.start_layer_wise_loading())
            assert wrong_bytes(pool, dest, want[i * pages : (i + 1) * pages]) == 0
    finally:
        lk.close()


def test_a_hint_whose_fetch_was_refused_rides_on_the_requests_next_fetch(pool):
    """The hint is attached to one fetch; when the budget refuses that fetch the
    adapter keeps the hint and the request's next admitted fetch carries it."""
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import DiscardHint, Fetch

    lk = make_linker(pool, max_inflight_prepare_bytes=PAGE_BYTES)
    adapter = lk._adapter
    seen = []

    def spy(kv):
        real = kv.submit_hint
        kv.submit_hint = lambda hint, rid: (seen.append(rid), real(hint, rid))[1]

    adapter.call(spy, timeout_s=10)
    try:
        release = stall_owner(lk)  # keep the first fetch (and its charge) in flight
        keys = tuple(lk.layout.block_key(h, "kv") for h in hashes_for(2, "miss"))
        labels = (lk.layout.pools[0].block_label,)
        hint = fetch_hint("tcp://127.0.0.1:1", hashes_for(1, "h")).copy()
        big = Fetch(
            op_id=adapter.next_op_id(),
            keys=keys,
            request_id="other#0",
            expected_layout=labels,
            nbytes=2 * PAGE_BYTES,
        )
        first = Fetch(
            op_id=adapter.next_op_id(),
            keys=keys[:1],
            request_id="r#0",
            expected_layout=labels,
            nbytes=PAGE_BYTES,
            hint=hint,
        )
        adapter.submit(big)
        adapter.submit(first)  # over budget: refused, its hint kept
        assert adapter.stats().refused_prepare == 1
        release()
        wait_until(lambda: adapter.stats().inflight_prepare_bytes == 0, what="drained")
        second = Fetch(
            op_id=adapter.next_op_id(),
            keys=keys[1:],
            request_id="r#0",
            expected_layout=labels,
            nbytes=PAGE_BYTES,
        )
        adapter.submit(second)
        wait_until(lambda: seen == ["r#0"], what="hint submitted with the next fetch")
        adapter.submit(DiscardHint("r#0"))
        adapter.wait_idle(10)
        lk._pump()
    finally:
        lk.close()


def test_peer_fetches_stop_once_quarantined_dram_reaches_its_bound(pool):
    """A flush that cannot prove quiescence quarantines a DRAM share; at the
    bound the worker stops taking peer fetches (hints ignored and counted), so no
    later flush can be held up by a peer again; local restores go on."""
    lk = make_linker(pool, max_quarantined_cores=1)
    try:
        hashes = hashes_for(2, "quar")
        peer_hint = fetch_hint("tcp://127.0.0.1:1", hashes)
        handle = lk.prepare_request(
            LinkerRequestContext("h0", 0, peer_hint), kv_transfer(hashes)
        )
        assert lk.stats.hints_quarantine_off == 0
        lk.release_request("h0")
        del handle
        real_close = lk._adapter.close
        lk._adapter.close = lambda timeout_s=None: (real_close(timeout_s), False)[1]
        lk.reset()  # the old core "could not close": its DRAM is quarantined
        assert lk.quarantined_bytes() > 0 and "peer_fetches_off=1" in lk.stats_line()
        fetches = lk._adapter.stats().fetches
        handle = lk.prepare_request(
            LinkerRequestContext("h1", 0, peer_hint), kv_transfer(hashes)
        )
        assert lk.preparation_ready(handle)  # nothing to fetch: ready at once
        assert lk.stats.hints_quarantine_off == 1
        assert lk._adapter.stats().fetches == fetches
        fill_random(pool, [5], seed=9)
        want = [page_bytes(pool, 5)]
        local = hashes_for(1, "local-after")
        assert offload_and_commit(lk, local, [5], "cpu") is True
        prepare(lk, "loc", local)
        assert lk.load("loc", kv_transfer(local, [9])) is True
        assert lk.finish_layer_wise_loading(lk.start_layer_wise_loading())
        assert wrong_bytes(pool, [9], want) == 0
    finally:
        lk.close()


class _RetainedKVCR:
    """What an unclean close leaves behind: a KVCR whose dead peer's operation
    is unresolved until the peer comes back (a restart on the same endpoint)."""

    def __init__(self) -> None:
        self.quiescent = False
        self.closed = 0
        self._core = self  # kvcr asks its core

    def is_quiescent(self) -> bool:
        return self.quiescent

    def close(self) -> None:
        assert self.quiescent
        self.closed += 1


def _close_uncleanly(adapter, retained):
    real_close = adapter.close

    def close(timeout_s=None):
        real_close(timeout_s)
        adapter.retained = RetainedCore(retained, "stand-in")
        adapter._clean_close = False
        return False

    adapter.close = close


def test_a_quarantined_core_that_proves_quiescent_gives_its_dram_back(pool):
    """Quarantined DRAM is reused, without a new allocation, once its core has
    proven quiescent and closed; peer fetches resume under the bound; a core
    that has not proven it keeps its DRAM out of reach."""
    lk = make_linker(pool, max_quarantined_cores=1)
    try:
        hashes = hashes_for(2, "reclaim")
        peer_hint = fetch_hint("tcp://127.0.0.1:1", hashes)
        original = dict(lk.dram.storage)
        first = {name: t.data_ptr() for name, t in original.items()}
        retained = _RetainedKVCR()
        _close_uncleanly(lk._adapter, retained)
        lk.reset()
        quarantined = lk.quarantined_bytes()
        assert quarantined == sum(t.numel() for t in lk.dram.storage.values()) > 0
        assert all(lk.dram.storage[n].data_ptr() != p for n, p in first.items())
        assert "peer_fetches_off=1" in lk.stats_line()
        lk.reset()  # still unresolved: still quarantined, nothing reused
        assert lk.quarantined_bytes() == quarantined and retained.closed == 0
        retained.quiescent = True  # the dead peer came back
        lk.reset()
        assert retained.closed == 1
        assert lk.quarantined_bytes() == 0 and "peer_fetches_off=0" in lk.stats_line()
        lk.prepare_request(LinkerRequestContext("p", 0, peer_hint), kv_transfer(hashes))
        assert lk.stats.hints_quarantine_off == 0  # the hint is taken again
        lk.release_request("p")
        # The next unclean flush gets the reclaimed (zeroed) DRAM, not new memory.
        for t in original.values():
            t.fill_(7)  # what the old core left in it
        _close_uncleanly(lk._adapter, _RetainedKVCR())
        lk.reset()
        assert {n: t.data_ptr() for n, t in lk.dram.storage.items()} == first
        assert all(int(t.count_nonzero()) == 0 for t in lk.dram.storage.values())
    finally:
        lk.close()


def test_restore_verdicts_fail_closed_when_ranks_or_records_disagree(linker):
    """A rid the linker has no record of did not land; and if another rank
    reduces a different number of loading requests, every one is aborted rather
    than a collective of mismatched size."""
    wrapper = _Wrapper(linker, ["ghost"], -1)
    assert integration._around_finish_loads(lambda w: [], wrapper) == ["ghost"]

    wrapper = _Wrapper(linker, ["a", "b"], -1)

    def other_rank_has_three(t, op):
        if t.tolist() == [2, -2]:
            t.copy_(torch.tensor([2, -3]))
        wrapper.reduced.append(t.tolist())

    wrapper.cache._all_reduce_attn_groups = other_rank_has_three
    assert integration._around_finish_loads(lambda w: [], wrapper) == ["a", "b"]
    assert wrapper.reduced == [[2, -3]]  # no per-request reduction attempted


def test_past_the_quarantine_bound_the_linker_stops_instead_of_growing(pool):
    """max_quarantined_cores=1: the first unclean flush quarantines a share
    (peer fetches stop); the second would exceed the bound, so the new core gets
    one page per pool and the linker restores and stores nothing; once the cores
    prove quiescent it gets a full share and works again."""
    lk = make_linker(pool, max_quarantined_cores=1)
    try:
        full = sum(t.numel() for t in lk.dram.storage.values())
        one_page = full // kvcr_layout_pages(lk)
        first, second = _RetainedKVCR(), _RetainedKVCR()
        _close_uncleanly(lk._adapter, first)
        lk.reset()
        assert lk.quarantined_bytes() == full and not lk.dram.disabled
        _close_uncleanly(lk._adapter, second)
        lk.reset()
        assert lk.dram.disabled and lk.quarantined_bytes() == 2 * full
        assert sum(t.numel() for t in lk.dram.storage.values()) == one_page
        fill_random(pool, [2], seed=4)
        hashes = hashes_for(1, "disabled")
        assert offload_and_commit(lk, hashes, [2], "cpu") is False  # stores nothing
        misses = lk.stats.miss_restore_disabled
        handle = lk.prepare_request(LinkerRequestContext("x"), kv_transfer(hashes))
        assert lk.preparation_ready(handle)
        assert lk.lookup("x", kv_transfer(hashes)) == []
        assert lk.stats.miss_restore_disabled == misses + 1
        lk.release_request("x")
        # The old cores prove quiescent at a flush that is itself unclean: back
        # under the bound (one core quarantined), so a full share again.
        first.quiescent = second.quiescent = True
        _close_uncleanly(lk._adapter, _RetainedKVCR())
        lk.reset()
        assert not lk.dram.disabled
        assert lk.quarantined_bytes() == one_page  # the disabled core's page
        assert sum(t.numel() for t in lk.dram.storage.values()) == full
        assert offload_and_commit(lk, hashes, [2], "cpu") is True
    finally:
        lk.close()


def kvcr_layout_pages(lk) -> int:
    from sglang.srt.mem_cache.storage.kvcr.layout import page_layout

    budget = lk.config.local_dram_bytes_per_worker
    return page_layout.plan_capacity(lk.layout, budget, 1).pages


def test_zero_quarantined_cores_stops_peer_fetches_for_good(pool):
    """max_quarantined_cores=0: the first quarantine stops peer fetches, and
    they stay off even after its core is reclaimed."""
    lk = make_linker(pool, max_quarantined_cores=0)
    try:
        retained = _RetainedKVCR()
        _close_uncleanly(lk._adapter, retained)
        lk.reset()
        assert lk.dram.peer_fetches_off
        retained.quiescent = True
        lk.reset()
        assert lk.quarantined_bytes() == 0 and lk.dram.peer_fetches_off
    finally:
        lk.close()


def test_dram_a_restore_copy_may_still_read_is_never_reclaimed(pool):
    """KVCR closed cleanly, but a restore batch was still copying at the
    deadline: its DRAM stays quarantined at every later flush."""
    lk = make_linker(pool, max_quarantined_cores=4)
    try:
        with mock.patch.object(lk.restorer, "quiesce", return_value=(False, [])):
            lk.reset()
        held = lk.quarantined_bytes()
        assert held > 0
        lk.reset()
        lk.reset()
        assert lk.quarantined_bytes() == held
    finally:
        lk.close()


def test_a_second_load_for_one_request_releases_the_first_ones_claims(linker, pool):
    fill_random(pool, [1, 2], seed=8)
    hashes = hashes_for(2, "twice")
    assert offload_and_commit(linker, hashes, [1, 2], "cpu") is True
    prepare(linker, "t", hashes)
    released = linker._adapter.stats().claims_released
    assert linker.load("t", kv_transfer(hashes, [20, 21])) is True
    assert linker.load("t", kv_transfer(hashes, [22, 23])) is True  # replaces it
    wait_until(
        lambda: linker._adapter.stats().claims_released - released == 2,
        what="the replaced job's claims released",
    )
    assert linker.finish_layer_wise_loading(linker.start_layer_wise_loading()) is False
    assert linker.claims_outstanding() == 0


def test_hints_are_ignored_when_attention_ranks_span_nodes(pool, monkeypatch):
    """A hint names one host; rank r on another node would dial rank 0's host.
    With --nnodes 2 hints are ignored and counted."""

    # Rank 0 of a two-rank attention group (no process group in this test).
    from sglang.srt.mem_cache.storage.kvcr import rank_setup

    monkeypatch.setattr(rank_setup, "attn_rank", lambda params: (0, 2))
    lk = make_linker(pool, server_args={"nnodes": 2})
    try:
        assert lk.placement.multi_node
        hashes = hashes_for(2, "multinode")
        ctx = LinkerRequestContext("m", 0, fetch_hint("tcp://127.0.0.1:1", hashes))
        handle = lk.prepare_request(ctx, kv_transfer(hashes))
        assert lk.preparation_ready(handle)
        assert lk.stats.hints_multinode_off == 1
        assert "hints_multinode_off=1" in lk.stats_line()
        lk.release_request("m")
    finally:
        lk.close()


def test_a_hint_naming_this_worker_in_another_spelling_is_still_local():
    """Host case and address spelling do not make this worker a NIXL peer."""
    from sglang.srt.mem_cache.storage.kvcr.fleet.router_hint import (
        EndpointAllowlist,
        RouterHintParser,
        own_endpoints,
        request_hint,
    )
    from sglang.srt.mem_cache.storage.kvcr.observability.linker_stats import LinkerStats

    names = own_endpoints("tcp://Worker-1.Example:47000", ("0.0.0.0", "10.0.0.5"))
    assert names == {"tcp://worker-1.example:47000", "tcp://10.0.0.5:47000"}
    parser = RouterHintParser(
        EndpointAllowlist(("worker-1.example", "10.0.0.5"), ""), rank_offset=0
    )
    hashes = hashes_for(1, "self-spelling")
    stats = LinkerStats()
    for spelling in ("tcp://WORKER-1.example:47000", "tcp://10.0.0.5:47000"):
        ctx = LinkerRequestContext("s", 0, fetch_hint(spelling, hashes))
        got = request_hint(parser, ctx, hashes, names, False, False, stats)
        assert got.hint is None, spelling
    assert stats.hints_self == 2
    ctx = LinkerRequestContext("s", 0, fetch_hint("tcp://10.0.0.5:47001", hashes))
    assert request_hint(parser, ctx, hashes, names, False, False, stats).hint


def test_staged_offload_events_follow_the_page_number_kernels(linker, pool):
    """The ready events a staged copy waits on are recorded after the device
    page numbers are computed (else its stream could read them unwritten)."""
    from sglang.srt.mem_cache.storage.kvcr.datapath import offloader as offloader_mod

    order: list[str] = []
    real = offloader_mod.page_numbers

    def numbers(*args):
        order.append("page_numbers")
        return real(*args)

    def ready():
        order.append("ready_events")
        return ()

    with mock.patch.object(offloader_mod, "page_numbers", numbers):
        linker.offloader.offload(
            kv_transfer(hashes_for(1, "order"), [3]),
            linker._adapter,
            ready,
            False,
        )
    assert order == ["page_numbers", "ready_events"]
    wait_until(lambda: linker.num_completed_offloads() == 1, what="offload result")
    linker.pop_completed_offload()
