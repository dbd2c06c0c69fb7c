"""Sliding-window (SWA) pools: KVCR pools ``kv`` + ``swa`` over a real CPU SWAKVPool.

A FULL+SWA model keeps full-attention layers in one MHA sub-pool and window layers
in another, addressed by separate device indices. The linker stores both per page,
and a boundary is restorable only when every page up to it has full-attention KV
and its trailing window has SWA KV; the restorable set is sparse when a window page
in the middle is missing (0.5.23's restorable-boundary convention). Real kvcr + NIXL.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from cpu_harness import kvcr_stack
from cpu_harness.kvcr_pages import (
    buffers,
    fill_random,
    make_linker,
    page_bytes,
    wait_until,
)
from sglang.srt.mem_cache.storage.kvcr.layout.pool_layout import KVCRLayoutError
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
)

pytestmark = pytest.mark.kvcr

PAGE = 4
HEADS = 2
DIM = 8
TOKENS = 64 * PAGE
FULL_LAYERS = (0, 2)
SWA_LAYERS = (1, 3)
WINDOW_PAGES = 2
FULL_SWA = {ComponentType.FULL, ComponentType.SWA}


def make_swa_pool():
    return kvcr_stack.swa_kv_pool(TOKENS, PAGE, HEADS, DIM, FULL_LAYERS, SWA_LAYERS)


# make_linker options (beside its components) of a linker over the SWA pool.
SWA_LINKER = {"model": "tiny-swa", "local_dram_bytes_per_worker": 1 << 20}


@pytest.fixture
def pool():
    return make_swa_pool()


@pytest.fixture
def linker_options():
    """What the conftest's ``linker`` fixture builds here: the FULL+SWA linker."""
    return {"components": FULL_SWA, **SWA_LINKER}


def hashes(n, salt="s"):
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


def slots(pages):
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)])


def transfers(keys, kv_pages=None, window_keys=None, swa_pages=None):
    """A KV transfer over ``keys`` and an SWA transfer over ``window_keys`` (by
    default the trailing WINDOW_PAGES of ``keys``), as the components build them."""
    if window_keys is None:
        window_keys = keys[-WINDOW_PAGES:]
    out = [
        PoolTransfer(
            name=PoolName.KV,
            keys=list(keys),
            device_indices=None if kv_pages is None else slots(kv_pages),
            hit_policy=PoolHitPolicy.ALL_PAGES,
        )
    ]
    if window_keys:
        out.append(
            PoolTransfer(
                name=PoolName.SWA,
                keys=list(window_keys),
                device_indices=None if swa_pages is None else slots(swa_pages),
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            )
        )
    return out


def slot_bytes(sub_pool, slots):
    """Every K and V byte of ``slots`` in ``sub_pool``."""
    return torch.cat(
        [b[slots].reshape(-1).view(torch.uint8) for b in buffers(sub_pool)]
    )


def offload(linker, xfers):
    assert linker.offload(xfers) is True
    wait_until(lambda: linker.num_completed_offloads() >= 1, what="offload")
    return linker.pop_completed_offload()


def prepare(linker, rid, keys):
    handle = linker.prepare_request(LinkerRequestContext(rid), transfers(keys))
    wait_until(lambda: linker.preparation_ready(handle), what="preparation")


def test_layout_has_a_window_pool_on_model_layers(pool, linker):
    kv, swa = linker.layout.pool("kv"), linker.layout.pool("swa")
    assert not kv.trailing and swa.trailing and swa.indices_from == "swa"
    assert sorted({s.layer for s in kv.spans}) == list(FULL_LAYERS)
    assert sorted({s.layer for s in swa.spans}) == list(SWA_LAYERS)
    assert linker.num_layers == 4
    assert set(linker.pools) == {PoolName.KV, PoolName.SWA}  # the wrapper restores SWA


def test_full_and_window_pages_round_trip_byte_exact(pool, linker):
    """Full layers of every page and window layers of the trailing pages land in
    the load's own slots of each sub-pool; nothing else changes."""
    full, window = pool.full_kv_pool, pool.swa_kv_pool
    keys = hashes(4)
    fill_random(full, [1, 2, 3, 4], seed=1)
    fill_random(window, [5, 6], seed=2)
    want_full = [page_bytes(full, p).clone() for p in (1, 2, 3, 4)]
    want_window = [page_bytes(window, p).clone() for p in (5, 6)]
    untouched = (page_bytes(full, 30).clone(), page_bytes(window, 30).clone())
    assert offload(linker, transfers(keys, [1, 2, 3, 4], keys[2:], [5, 6])) is True
    fill_random(full, [1, 2, 3, 4], seed=3)
    fill_random(window, [5, 6], seed=4)

    prepare(linker, "r", keys)
    assert linker.lookup("r", transfers(keys)) == [4]  # windows of 1..3 reach pages 0-1
    assert linker.load("r", transfers(keys, [10, 11, 12, 13], keys[2:], [20, 21]))
    index = linker.start_layer_wise_loading()
    assert linker.finish_layer_wise_loading(index) is True
    for want, page in zip(want_full, (10, 11, 12, 13), strict=True):
        assert torch.equal(page_bytes(full, page), want)
    for want, page in zip(want_window, (20, 21), strict=True):
        assert torch.equal(page_bytes(window, page), want)
    assert torch.equal(page_bytes(full, 30), untouched[0])
    assert torch.equal(page_bytes(window, 30), untouched[1])
    assert linker.claims_held() == 0


def test_staged_offload_stages_each_pool_from_its_own_device_pages(pool):
    """The staged path copies full pages from the full pool and window pages from
    the SWA pool (different device indices) before the deposit; both restore."""
    linker = make_linker(pool, components=FULL_SWA, **SWA_LINKER, offload_path="staged")
    try:
        full, window = pool.full_kv_pool, pool.swa_kv_pool
        keys = hashes(3, "st")
        fill_random(full, [2, 3, 4], seed=12)
        fill_random(
            window, [7, 9], seed=13
        )  # window pages live elsewhere in the SWA pool
        want_full = [page_bytes(full, p).clone() for p in (2, 3, 4)]
        want_window = [page_bytes(window, p).clone() for p in (7, 9)]
        assert offload(linker, transfers(keys, [2, 3, 4], keys[1:], [7, 9])) is True
        prepare(linker, "st", keys)
        assert linker.lookup("st", transfers(keys)) == [3]
        assert linker.load("st", transfers(keys, [30, 31, 32], keys[1:], [40, 41]))
        assert linker.finish_layer_wise_loading(linker.start_layer_wise_loading())
        for want, page in zip(want_full, (30, 31, 32), strict=True):
            assert torch.equal(page_bytes(full, page), want)
        for want, page in zip(want_window, (40, 41), strict=True):
            assert torch.equal(page_bytes(window, page), want)
    finally:
        linker.close()


def test_restorable_set_is_sparse_where_a_window_page_is_missing(pool, linker):
    """SWA KV for pages 0,1,4,5 but not 2,3 (window 2): boundaries 1, 2 and 6."""
    keys = hashes(6, "sp")
    fill_random(pool.full_kv_pool, range(1, 7), seed=5)
    fill_random(pool.swa_kv_pool, range(1, 7), seed=6)
    first = transfers(keys[:2], [1, 2], keys[:2], [1, 2])
    rest = transfers(keys[2:], [3, 4, 5, 6], keys[4:], [5, 6])
    assert offload(linker, first) is True and offload(linker, rest) is True
    prepare(linker, "sp", keys)
    assert linker.lookup("sp", transfers(keys)) == [1, 2, 6]
    # A tail shorter than the window needs window KV for all of it.
    prepare(linker, "short", keys[:3])
    assert linker.lookup("short", transfers(keys[:3], window_keys=keys[1:3])) == [1, 2]


def test_restore_of_a_middle_boundary_uses_that_boundary_s_window(pool, linker):
    """Restoring boundary 2 of the sparse set copies full KV of pages 0-1 and window
    KV of pages 0-1; the claims past the boundary are released with the load."""
    keys = hashes(6, "mid")
    fill_random(pool.full_kv_pool, range(1, 7), seed=7)
    fill_random(pool.swa_kv_pool, range(1, 7), seed=8)
    want = [page_bytes(pool.full_kv_pool, p).clone() for p in (1, 2)]
    want_window = [page_bytes(pool.swa_kv_pool, p).clone() for p in (1, 2)]
    assert offload(linker, transfers(keys[:2], [1, 2], keys[:2], [1, 2])) is True
    assert offload(linker, transfers(keys[2:], [3, 4, 5, 6], keys[4:], [5, 6])) is True
    prepare(linker, "m", keys)
    assert 2 in linker.lookup("m", transfers(keys))
    assert linker.load("m", transfers(keys[:2], [40, 41], keys[:2], [40, 41]))
    assert linker.finish_layer_wise_loading(linker.start_layer_wise_loading())
    for got, expected in zip(
        [page_bytes(pool.full_kv_pool, p) for p in (40, 41)], want, strict=True
    ):
        assert torch.equal(got, expected)
    for got, expected in zip(
        [page_bytes(pool.swa_kv_pool, p) for p in (40, 41)], want_window, strict=True
    ):
        assert torch.equal(got, expected)
    assert linker.claims_held() == 0  # pages 2-5 can never be restored now
    linker.release_request("m")
    assert linker.claims_held() == 0


def test_load_without_window_claims_fails_rather_than_restoring_stale_window(
    pool, linker
):
    """A load whose window pages are not claimed fails the batch (no bytes move)."""
    keys = hashes(3, "nw")
    fill_random(pool.full_kv_pool, [1, 2, 3], seed=9)
    assert offload(linker, transfers(keys, [1, 2, 3], window_keys=[])) is True
    prepare(linker, "nw", keys)
    assert linker.lookup("nw", transfers(keys)) == []
    before = page_bytes(pool.swa_kv_pool, 50).clone()
    assert linker.load("nw", transfers(keys, [50, 51, 52], keys[1:], [50, 51]))
    assert linker.finish_layer_wise_loading(linker.start_layer_wise_loading()) is False
    assert torch.equal(page_bytes(pool.swa_kv_pool, 50), before)
    linker.release_request("nw")
    assert linker.claims_held() == 0


def test_mamba_components_are_refused_naming_the_flag(pool):
    with pytest.raises(
        KVCRLayoutError, match=r"Mamba.*--unified-cache-external-linker"
    ):
        make_linker(
            pool,
            components={ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA},
            **SWA_LINKER,
        )


def test_swa_component_needs_a_swa_pool():
    plain = kvcr_stack.mha_pool(TOKENS, PAGE, HEADS, DIM, 2)
    with pytest.raises(KVCRLayoutError, match="SWA needs an SWAKVPool"):
        make_linker(plain, components=FULL_SWA, **SWA_LINKER)
    with pytest.raises(KVCRLayoutError, match="SWA needs an SWAKVPool"):
        make_linker(make_swa_pool(), components={ComponentType.FULL}, **SWA_LINKER)


def test_swa_digest_differs_from_a_plain_pool_of_the_same_geometry(pool, linker):
    plain = kvcr_stack.mha_pool(TOKENS, PAGE, HEADS, DIM, 4)
    other = make_linker(plain, components={ComponentType.FULL}, **SWA_LINKER)
    try:
        assert other.layout.compatibility_digest != linker.layout.compatibility_digest
    finally:
        other.close()


# ---- through SGLang's wrapper and a real FULL+SWA UnifiedRadixCache ---------------


def test_swa_tail_restores_through_the_unified_cache_bit_exact(plugin_hooks):
    """Insert (write-through to KVCR), evict from the device, then a request's match,
    load_back and layer-wise restore put back full KV for the tail and window KV
    for its trailing window, where the SWA component maps the private slots."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.sampling.sampling_params import SamplingParams

    from cpu_harness import kvcr_stack

    geometry = kvcr_stack.Geometry(
        page=PAGE,
        layers=4,
        heads=HEADS,
        dim=DIM,
        pool_tokens=TOKENS,
        sliding_window=WINDOW_PAGES * PAGE,
    )
    config = {
        "local_dram_bytes_per_worker": 1 << 20,
        "operation_timeout_ms": 5000,
        "abandon_timeout_ms": 10000,
        "preparation_timeout_ms": 10000,
    }
    stack = kvcr_stack.build_stack(config, geometry)
    cache, linker, allocator = stack.cache, stack.linker, stack.allocator
    full, window = stack.kvcache.full_kv_pool, stack.kvcache.swa_kv_pool
    try:
        assert set(linker.pools) == {PoolName.KV, PoolName.SWA}
        tokens = list(range(100, 100 + 5 * PAGE))
        n = torch.tensor([len(tokens)])
        zero, last = torch.tensor([0]), torch.tensor([-1])
        slots = allocator.alloc_extend(zero, zero, n, n, last, len(tokens))
        swa_slots = allocator.translate_loc_from_full_to_swa(slots)
        fill_random(full, slots, seed=11, page=1)
        fill_random(window, swa_slots, seed=12, page=1)
        want_full = slot_bytes(full, slots)
        tail = slice(len(tokens) - WINDOW_PAGES * PAGE, len(tokens))
        want_window = slot_bytes(window, swa_slots[tail])
        key = RadixKey(array("q", tokens))
        cache.insert(InsertParams(key=key, value=slots))

        def committed():
            cache.check_hicache_events()
            return not cache.linker.pending_offloads

        wait_until(committed, what="offloads committed")
        cache.evict(EvictParams(num_tokens=len(tokens), swa_num_tokens=len(tokens)))
        probe = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        assert probe.device_prefix_len == 0
        for sub in (full, window):
            for buf in buffers(sub):
                buf.zero_()

        req = Req(
            "swa", "", array("q", [*tokens, 1, 2]), SamplingParams(max_new_tokens=1)
        )
        # What the enqueue hook does: prepare the tail, then wait until ready.
        from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import integration

        handle = integration.wrapper_prepare_request(cache.linker, req)
        ready = cache.linker.cache_linker.preparation_ready
        wait_until(lambda: ready(handle), what="tail prepared")
        req.init_next_round_input(cache)
        assert req.host_hit_length == len(tokens)
        loaded = kvcr_stack.load_back(cache, req)
        assert loaded[0] == len(tokens)
        private = cache.linker.private_load_indices[req.rid].clone()
        assert cache.ready_to_load_host_cache() >= 0
        assert cache.finish_external_linker_loads([req]) == []
        assert torch.equal(slot_bytes(full, private), want_full)
        private_window = allocator.translate_loc_from_full_to_swa(private[tail])
        assert torch.equal(slot_bytes(window, private_window), want_window)
        assert linker.claims_held() == 0
    finally:
        linker.close()


def test_unified_memory_swa_allocator_is_refused_naming_the_flag(pool):
    """Virtual SWA pages (unified memory pool) would be written as physical rows."""
    from sglang.srt.mem_cache.allocator.unified_hybrid_swa import (
        UnifiedSWAAllocatorBase,
    )

    class _Unified(kvcr_stack.PoolAllocator, UnifiedSWAAllocatorBase):
        pass  # no real unified pool behind it: only its type is inspected

    _Unified.__abstractmethods__ = frozenset()

    with pytest.raises(KVCRLayoutError, match="--enable-unified-memory"):
        kvcr_stack.bare_linker(
            pool,
            PAGE,
            {"local_dram_bytes_per_worker": 1 << 20},
            components=FULL_SWA,
            allocator=_Unified(pool),
        )


def test_window_that_is_not_the_restored_tail_fails_the_load(pool, linker):
    """A load whose SWA keys are not the trailing pages of its KV keys (or are
    missing) restores nothing rather than leaving window rows stale."""
    keys = hashes(4, "tail")
    fill_random(pool.full_kv_pool, [1, 2, 3, 4], seed=14)
    fill_random(pool.swa_kv_pool, [1, 2, 3, 4], seed=15)
    assert offload(linker, transfers(keys, [1, 2, 3, 4], keys, [1, 2, 3, 4])) is True
    for rid, window in (("mid", keys[1:3]), ("none", [])):
        prepare(linker, rid, keys)
        assert linker.lookup(rid, transfers(keys)) == [1, 2, 3, 4]
        before = page_bytes(pool.full_kv_pool, 50).clone()
        swa_pages = [50, 51][: len(window)] if window else None
        xfers = transfers(keys, [50, 51, 52, 53], window, swa_pages)
        assert linker.load(rid, xfers) is True
        assert (
            linker.finish_layer_wise_loading(linker.start_layer_wise_loading()) is False
        )
        assert torch.equal(page_bytes(pool.full_kv_pool, 50), before)
        linker.release_request(rid)
    assert linker.claims_held() == 0


def test_lookup_without_window_keys_requires_window_kv_for_every_page(pool, linker):
    """No SWA keys in the lookup: conservatively, every page needs window KV."""
    keys = hashes(3, "nokeys")
    fill_random(pool.full_kv_pool, [1, 2, 3], seed=16)
    fill_random(pool.swa_kv_pool, [2, 3], seed=17)
    assert offload(linker, transfers(keys, [1, 2, 3], keys[1:], [2, 3])) is True
    prepare(linker, "nk", keys)
    assert linker.lookup("nk", transfers(keys, window_keys=[])) == []
    assert linker.lookup("nk", transfers(keys)) == [3]
