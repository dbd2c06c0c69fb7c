"""DeepSeek V4 pool layouts: each round trips byte-exact, each has its own digest,
and pools that keep SWA per request are refused.

The family tests (``test_kvcr_families.py``) run the default V4 layout; here every
other layout SGLang builds on CPU (V4.1 and V4.1-new main caches, ratio-1/2
layers sharing source KV, the trtllm uniform FP8 rows, one MTP layer whose SWA
rides the target's SWA entry) goes through the same insert, write-through,
device eviction, match, load back and finish, with every compressed KV,
indexer, SWA and compress-state row compared. Real kvcr + NIXL.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from cpu_harness import kvcr_families, kvcr_stack
from cpu_harness.kvcr_dsv4 import DSV4_VARIANTS, per_request_pool
from sglang.srt.mem_cache.storage.kvcr.layout import pool_group_layout
from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import PageLayout
from sglang.srt.mem_cache.storage.kvcr.layout.pool_layout import (
    KVCRLayoutError,
    ModelIdentity,
)

pytestmark = pytest.mark.kvcr
IDENTITY = ModelIdentity("org/model", "rev", "", 0, 2)


@pytest.mark.parametrize("variant", [v for v in DSV4_VARIANTS if v != "v4"])
def test_every_deepseek_v4_pool_layout_round_trips_byte_exact(
    plugin_hooks: None, variant: str
):
    """V4.1 layouts, ratio-1/2 layers sharing source KV, the trtllm uniform FP8
    rows and an MTP layer's SWA: every compressed KV, indexer, SWA and compress
    state row of the restored prefix lands as written. DeepSeek V4 is
    rank-replicated but windowed, so every rank stores its own pages."""
    from sglang.srt.mem_cache.storage.kvcr.datapath.replica_broadcast import stores_once

    stack = kvcr_families.build("DeepSeek V4", variant)
    try:
        assert stack.linker.layout.rank_replicated
        assert not stores_once(stack.linker.layout, 2)
        rt = kvcr_families.round_trip(stack, pages=3, seed=2)
        assert rt.host_hit_length == rt.loaded_tokens == 3 * stack.page
        assert rt.failed == [] and rt.stray == []
        assert set(rt.landed) == set(rt.written)
        for kind, rows in rt.written.items():
            assert len(rt.landed[kind]) == len(rows) > 0
            for want, got in zip(rows, rt.landed[kind], strict=True):
                assert torch.equal(got, want), (variant, kind)
        assert stack.linker.claims_held() == 0
    finally:
        stack.linker.close()


def test_each_deepseek_v4_pool_layout_has_its_own_digest(plugin_hooks: None):
    digests = set()
    for variant, spec in DSV4_VARIANTS.items():
        kvcr_families.publish_server_args(256, **spec.get("server_args", {}))
        parts = kvcr_families.family_parts("DeepSeek V4", 256, variant)
        params = SimpleNamespace(
            page_size=256,
            req_to_token_pool=parts["r2t"],
            mtp_draft_device_pools=parts.get("mtp", ()),
            sidecar_draft_device_pools=(),
        )
        _, group = pool_group_layout.pool_group(
            parts["kvcache"], params, set(parts["components"])
        )
        layout = PageLayout.from_pool_group(group, identity=IDENTITY)
        digests.add(layout.compatibility_digest)
    assert len(digests) == len(DSV4_VARIANTS)


@pytest.mark.parametrize(
    "attr", ["unified_kv_pool", "request_window", "swa_req_ring_size"]
)
def test_deepseek_v4_swa_kept_per_request_is_refused(attr: str):
    """unified_kv, encoder SWA replay and the DSpark draft ring keep SWA per
    request, outside the tree: no page layout describes them."""
    with pytest.raises(KVCRLayoutError) as info:
        kvcr_stack.bare_linker(
            per_request_pool(attr),
            256,
            {"local_dram_bytes_per_worker": 1 << 20},
            components={ComponentType.FULL, ComponentType.SWA},
        )
    message = str(info.value)
    assert message.startswith("DeepSeek V4 per-request SWA model:"), message
    assert attr.removesuffix("_pool").removesuffix("_size") in message.replace(" ", "_")


def test_an_mtp_draft_not_on_the_targets_swa_pages_is_refused(plugin_hooks: None):
    """SGLang packs an MTP draft's SWA rows into the target's SWA entry, so they
    are restored at the target's SWA pages: a draft addressed through another
    full-to-SWA mapping (or by full indices) would get wrong rows; refused."""
    kvcr_families.publish_server_args(256)
    parts = kvcr_families.family_parts("DeepSeek V4", 256, "v4_mtp")
    (draft,) = parts["mtp"]
    params = SimpleNamespace(
        page_size=256,
        req_to_token_pool=parts["r2t"],
        mtp_draft_device_pools=(draft,),
        sidecar_draft_device_pools=(),
    )
    components = set(parts["components"])
    assert pool_group_layout.pool_group(parts["kvcache"], params, components)
    draft.register_mapping(draft.full_to_swa_index_mapping.clone())
    with pytest.raises(KVCRLayoutError, match="MTP draft pool's SWA rows"):
        pool_group_layout.pool_group(parts["kvcache"], params, components)


def test_the_compared_state_rows_are_the_rows_sglang_addresses(plugin_hooks: None):
    """The harness compares a compress state's ring row per SWA page; SGLang's
    own addressing puts every position of SWA page ``p`` in ring row ``p``."""
    from cpu_harness.kvcr_dsv4 import dsv4_pool, dsv4_ring_rows

    kvcr_families.publish_server_args(256)
    pool = dsv4_pool(8 * 256, 4 * 256)
    states = [
        p
        for p in (*pool.compress_state_pools, *pool.indexer_compress_state_pools)
        if p is not None and not p.request_scoped
    ]
    assert len(states) == len(dsv4_ring_rows(pool)) == 4
    for state in states:
        ring = int(state.ring_size)
        for page in (1, 3):
            locs = torch.arange(page * 256, (page + 1) * 256)
            rows = state.translate_from_swa_loc_to_state_loc(locs) // ring
            assert set(rows.tolist()) == {page}
