"""Refusals of device pools the KVCR page layout cannot describe exactly.

``check_plain_pool`` guards the pools ``pool_group_layout.plain_group`` wraps
itself (only the dense ``MHATokenToKVPool``/``MLATokenToKVPool`` classes, no
page-major rows, no scale buffers); ``check_pool`` guards every entry of a
group SGLang builds: NHD slot rows of every layer, no layer sharding, and no
scale bytes the entry does not carry. Each refusal is a ``KVCRLayoutError``
naming the pool class, the family where known, and the setting to change.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from sglang.srt.mem_cache.storage.kvcr.layout.pool_layout import (
    SUPPORTED,
    KVCRLayoutError,
)

_SCALED = (
    "scaled KV caches (scale buffers) are not supported (model family 'scaled "
    "KV'; choose an unscaled --kv-cache-dtype)"
)


def check_plain_pool(pool: Any, page_size: int) -> None:
    """Refuse a pool ``plain_group`` cannot describe exactly (naming its class)."""
    from sglang.srt.mem_cache.memory_pool import (
        MHATokenToKVPool,
        MLATokenToKVPool,
        PageMajorMHATokenToKVPool,
    )

    name, attrs = type(pool).__name__, getattr(pool, "__dict__", {})
    if isinstance(pool, PageMajorMHATokenToKVPool):
        reason = (
            "page-major pools have no per-layer contiguous regions (model family "
            "'page-major/HND'; drop --enable-page-major-kv-layout)"
        )
    elif any(v is not None for k, v in attrs.items() if k.endswith("scale_buffer")):
        reason = _SCALED
    elif type(pool) not in (MHATokenToKVPool, MLATokenToKVPool):
        reason = "this pool class cannot be described"
    else:
        check_pool(pool, page_size)
        return
    raise KVCRLayoutError(f"{name}: {reason}; {SUPPORTED}")


def check_pool(
    pool: Any, page_size: int, carried: set[int] | None = None, family: str = ""
) -> None:
    """Refuse a device pool whose rows are not NHD token slots of every layer,
    or that keeps scale bytes no entry of its group carries (``carried``: the
    group's buffer addresses; None for a pool wrapped outside a group)."""
    name, attrs = type(pool).__name__, getattr(pool, "__dict__", {})
    in_group = carried is not None
    carried = carried or set()
    scales = [
        t
        for k, v in attrs.items()
        if k.endswith("scale_buffer") and v is not None
        for t in _tensors(v)
    ]
    reason = ""
    if any(t.data_ptr() not in carried for t in scales):
        reason = _SCALED
    elif str(getattr(pool, "kv_cache_layout", "nhd")) != "nhd":
        reason = (
            f"layout {pool.kv_cache_layout!r} is not NHD slot rows (model family "
            "'page-major/HND'; unset SGLANG_USE_HND_KVCACHE)"
        )
    elif getattr(pool, "layer_shard_enabled", False):
        reason = "layer-sharded pools do not own every layer"
    elif int(getattr(pool, "page_size", page_size)) != page_size and not in_group:
        reason = f"its page_size {pool.page_size} differs from {page_size}"
    if reason:
        where = f"{family} model, " if family else ""
        raise KVCRLayoutError(f"{name}: {where}{reason}; {SUPPORTED}")


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def draft_pool(params: Any) -> Any:
    """The one draft KV pool sharing the target's slots, if any (else None).

    Packed (MTP) and sidecar draft pools are both indexed by the target's token
    slots, so either becomes a ``draft`` KVCR pool keyed per page like ``kv``.
    """
    pools = [
        *getattr(params, "sidecar_draft_device_pools", ()),
        *getattr(params, "mtp_draft_device_pools", ()),
    ]
    if len(pools) > 1:
        raise KVCRLayoutError(
            f"the KVCR linker supports at most one draft KV pool, got {len(pools)} "
            "(--speculative-* settings); use a single draft model layer pool"
        )
    return pools[0] if pools else None


def linker_pools(layout: Any, components: Any) -> dict[Any, Any]:
    """``linker.pools`` for the wrapper: the group's entries (it restores SWA
    only if SWA is listed), each tree component's pool among them."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    kinds = {ComponentType(int(c)) for c in components or ()}
    pools = dict(layout.entry_map)
    sources = {p.indices_from for p in layout.pools}
    wanted = {ComponentType.FULL: "kv", ComponentType.SWA: "swa"}
    wanted[ComponentType.MAMBA] = "mamba"
    missing = sorted(k.name for k in kinds if wanted.get(k, "") not in sources)
    if missing:
        raise KVCRLayoutError(
            f"tree components {missing} have no pool in the KVCR page layout "
            f"{sorted(str(n) for n in pools)}; drop "
            "--unified-cache-external-linker-backend "
            "for this model"
        )
    return pools


def refuse_virtual_swa_pages(allocator: Any) -> None:
    """The unified memory pool hands out virtual SWA pages; restores write device
    rows directly, so only the static SWA allocator's physical indices are safe."""
    from sglang.srt.mem_cache.allocator.unified_hybrid_swa import (
        UnifiedSWAAllocatorBase,
    )

    if isinstance(allocator, UnifiedSWAAllocatorBase):
        raise KVCRLayoutError(
            f"{type(allocator).__name__}: the KVCR linker restores SWA KV into "
            "physical rows and does not support the unified (virtual-page) memory "
            "pool; drop --enable-unified-memory for this model"
        )
