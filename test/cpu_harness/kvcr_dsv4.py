"""DeepSeek V4 device pools on CPU for the model-family tests. Test support only.

``dsv4_pool`` builds a real ``DeepSeekV4TokenToKVPool`` with the model's per-token
geometry in one of the :data:`DSV4_VARIANTS` (main-cache layout, compress ratios,
ratio-1/2 source layers, the trtllm uniform FP8 rows, an MTP draft layer), sized
the way SGLang's configurator sizes it; ``dsv4_page_rows`` and ``dsv4_ring_rows``
list every buffer a prefix restore must write, as one byte row per full page
(compressed KV and indexer) or per SWA page (the compress-state rings).
"""

from __future__ import annotations

from typing import Any

import torch

# DeepSeek V4 pool variants that build on CPU: the main-cache layout, the
# per-layer compress ratios (0: SWA only) and the layers whose KV the ratio-1/2
# layers share (``kv_source_layers``).
DSV4_VARIANTS: dict[str, dict[str, Any]] = {
    "v4": {"ratios": (0, 4, 128, 4)},
    "v41": {"ratios": (0, 4, 128, 4), "kv_layout": "v41"},
    "v41_new": {"ratios": (0, 4, 128, 4), "kv_layout": "v41_new"},
    "v4_ratio12": {"ratios": (1, 2, 4, 128), "kv_source_layers": (0, 1)},
    "v41_ratio12": {
        "ratios": (1, 2, 4, 128),
        "kv_source_layers": (0, 1),
        "kv_layout": "v41",
    },
    # --dsv4-attn-backend trtllm: uniform 512-byte FP8 rows
    "v4_trtllm": {
        "ratios": (0, 4, 128, 4),
        "server_args": {"dsv4_attn_backend": "trtllm"},
    },
    # an MTP (NextN) draft layer, its SWA packed into the target's SWA entry
    "v4_mtp": {"ratios": (0, 4, 128, 4), "mtp_layers": 1},
    # no C128 layer: V4.1 and V4.1-new rows are then the same size everywhere
    "v41_c4": {"ratios": (0, 4, 4, 4), "kv_layout": "v41"},
    "v41_new_c4": {"ratios": (0, 4, 4, 4), "kv_layout": "v41_new"},
    # the FP4 indexer: payload and scale buffers in sibling entries
    "v4_fp4_indexer": {
        "ratios": (0, 4, 128, 4),
        "server_args": {"enable_deepseek_v4_fp4_indexer": True},
    },
}


def dsv4_pool(
    full: int, swa: int, page: int = 256, variant: str = "v4", draft: bool = False
) -> Any:
    """A DeepSeek V4 pool with the real per-token geometry (448 FP8 nope + 64 BF16
    rope, indexer 128): paged SWA, a KV (+ indexer) pool per compress ratio, and
    the C4 compress states, sized the way SGLang's configurator sizes them."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import (
        DeepSeekV4TokenToKVPool,
        KVLayout,
        get_compress_state_ring_size,
    )

    spec = DSV4_VARIANTS[variant]
    ratios = [0] * spec["mtp_layers"] if draft else list(spec["ratios"])
    return DeepSeekV4TokenToKVPool(
        max_num_reqs=4,
        swa_size=swa,
        c4_size=full // 4,
        c128_size=full // 128,
        c4_state_pool_size=swa // page * get_compress_state_ring_size(4),
        c128_state_pool_size=0,
        page_size=page,
        swa_page_size=page,
        dtype=torch.float8_e4m3fn,
        c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32,
        qk_nope_head_dim=448,
        qk_rope_head_dim=64,
        indexer_head_dim=128,
        layer_num=len(ratios),
        device="cpu",
        enable_memory_saver=False,
        compression_ratios=ratios,
        sliding_window=128,
        start_layer=0,
        end_layer=len(ratios),
        full_size=full,
        kv_source_layers=[] if draft else list(spec.get("kv_source_layers", ())),
        kv_layout=KVLayout.parse(spec.get("kv_layout", "v4")),
        is_draft_worker=draft,
    )


def dsv4_page_rows(pool: Any, page: int) -> dict[str, list[torch.Tensor]]:
    """Every compressed KV and indexer buffer of ``pool`` as one byte row per
    full page (``page`` tokens): ``c<ratio>`` and ``c<ratio>_indexer``."""
    out: dict[str, list[torch.Tensor]] = {}
    for ratio, kv in pool.kv_pools.items():
        if kv is not None:
            out[f"c{ratio}"] = list(kv.kv_buffer)
    for ratio, index in pool.index_pools.items():
        per_page = max(1, page // ratio // int(index.page_size))
        rows = []
        for buf in index.contiguous_page_row_buffers():
            pages = buf.shape[0] // per_page
            raw = buf[: pages * per_page].view(torch.uint8)
            rows.append(raw.reshape(pages, -1))
        out[f"c{ratio}_indexer"] = rows
    return out


def dsv4_ring_rows(pool: Any) -> list[torch.Tensor]:
    """Every SWA-page-addressed compress state as one byte row per SWA page (a
    page's ring of ``ring_size`` state rows); request-scoped C128 state is not
    part of a prefix."""
    rows = []
    for p in (*pool.compress_state_pools, *pool.indexer_compress_state_pools):
        if p is None or p.request_scoped:
            continue
        state, ring = p.kv_score_buffer.kv_score, int(p.ring_size)
        usable = state.shape[0] // ring * ring
        raw = state.view(torch.uint8).reshape(state.shape[0], -1)[:usable]
        rows.append(raw.reshape(usable // ring, -1))
    return rows


def per_request_pool(attr: str) -> Any:
    """An uninitialised ``DeepSeekV4TokenToKVPool`` with only ``attr`` set: the
    pool attribute that says SWA is kept per request (the linker refuses it
    from that alone)."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    pool = DeepSeekV4TokenToKVPool.__new__(DeepSeekV4TokenToKVPool)
    setattr(pool, attr, object())
    return pool
