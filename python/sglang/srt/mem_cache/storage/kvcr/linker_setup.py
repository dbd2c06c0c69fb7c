"""What the linker reads off SGLang at start-up, and what it refuses.

The attention rank and group size from the cache groups, the model identity a
page's digest covers, the one draft KV pool (if any), the model family and its
``DevicePoolGroup`` (``pool_group_layout``), whose entries are the pools the
wrapper hands the linker, and the refusal of the unified virtual-page memory
pool on SWA models: each refusal names the model family and the flag to change.
Then the rank's resources: its KVCR DRAM share, the span restorer and staging
area, the byte views restores copy into, and the arguments every KVCR
incarnation is built with.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from sglang.srt.mem_cache.storage.kvcr import kvcr_layout, model_identity
from sglang.srt.mem_cache.storage.kvcr.kvcr_layout import KVCRLayoutError

logger = logging.getLogger(__name__)


def attn_rank(params: Any) -> tuple[int, int]:
    """(attention-TP rank, size) of this process from its cache groups."""
    group = getattr(params, "attn_tp_cache_group", None) or getattr(
        params, "tp_cache_group", None
    )
    if group is None or not torch.distributed.is_initialized():
        return 0, 1
    return (
        torch.distributed.get_rank(group),
        torch.distributed.get_world_size(group),
    )


def kvcache_layout_identity(
    server_args: Any, rank: int, size: int
) -> kvcr_layout.ModelIdentity:
    """The model identity a page's compatibility digest covers (model_identity)."""
    fields = model_identity.model_identity_fields(server_args)
    return kvcr_layout.ModelIdentity(tp_rank=rank, tp_size=size, **fields)


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


def register_state_counter(params: Any, layout: Any, counter: Any) -> None:
    """Mamba state is read through the request pool, which waits on the layer
    counter only once it is registered there (as Mooncake does)."""
    if any(p.indices_from == "mamba" for p in layout.pools):
        params.req_to_token_pool.register_layer_transfer_counter(counter)


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


def page_rows(tensor: torch.Tensor, rows: int, page_bytes: int) -> torch.Tensor:
    """A byte view of a buffer with one row per page (``rows`` buffer rows)."""
    pages = tensor.shape[0] // rows
    flat = tensor[: pages * rows].reshape(-1).view(torch.uint8)
    return flat.view(pages, page_bytes)


@dataclasses.dataclass(slots=True)
class RankResources:
    """Host memory and copy machinery one rank's linker owns."""

    dram: Any  # quarantine.KVCRDram
    span: Any  # restore_copy.SpanRestore on CUDA hosts, else None
    staging: Any  # offload_staging.HostStaging on the staged path, else None
    dest_rows: dict[str, list[torch.Tensor]]  # per pool, each part's page rows

    def release(self, timeout_s: float) -> None:
        """Give back what nothing has used yet (a start-up that failed after)."""
        if self.staging is not None:
            self.staging.close(timeout_s)
        self.dram.memory.release_all()


def build_resources(
    layout: Any, cfg: Any, ranks_on_node: int, device: Any, page_size: int
) -> RankResources:
    """This rank's KVCR DRAM share (locked on GPU hosts, so restores are
    asynchronous), the span restorer and the staging area, all or nothing."""
    from sglang.srt.mem_cache.storage.kvcr.host_memory import HostMemory
    from sglang.srt.mem_cache.storage.kvcr.offload_staging import HostStaging
    from sglang.srt.mem_cache.storage.kvcr.quarantine import KVCRDram
    from sglang.srt.mem_cache.storage.kvcr.restore_copy import SpanRestore

    plan = kvcr_layout.plan_capacity(
        layout, cfg.local_dram_bytes_per_worker, ranks_on_node
    )
    logger.info(
        "KVCR capacity: %d pages per pool, %d bytes unused of the per-rank share",
        plan.pages,
        plan.unused_bytes,
    )
    dest_rows = {
        pool.name: [
            page_rows(t, pool.rows_per_page or page_size, pool.page_bytes)
            for t in pool.tensors
        ]
        for pool in layout.pools
    }
    memory = HostMemory(pin=device.is_cuda)
    try:
        dram = KVCRDram(memory, plan, cfg.max_quarantined_cores)
        span = SpanRestore(device.device, memory) if device.is_cuda else None
        staging = None
        path = cfg.offload_path
        if path == "staged" or (path == "auto" and device.is_cuda):
            cap = cfg.max_inflight_offload_bytes // layout.page_total
            staging = HostStaging(
                layout.pools,
                dest_rows,
                max(1, min(cap, 1 << 16)),
                memory=memory,
                device=device,
            )
    except BaseException:
        memory.release_all()  # nothing has used them yet
        raise
    return RankResources(dram, span, staging, dest_rows)


def factory_args(
    layout: Any, cfg: Any, control_port: int, res: RankResources
) -> dict[str, Any]:
    """``make_kvcr_factory``'s arguments but the agent name (per incarnation)."""
    from sglang.srt.mem_cache.storage.kvcr.control_auth import InboundGuard

    return {
        "pool_layouts": layout.kvcr_pool_layouts(),
        "framework_regions": (
            res.staging.region_descriptors()
            if res.staging is not None
            else layout.region_descriptors()
        ),
        "local_dram_pools": layout.local_dram_regions(list(res.dram.storage.values())),
        "key_adapter": kvcr_layout.KeyAdapter(layout),
        "control_bind_host": cfg.control_bind_host,
        "control_advertise_host": cfg.advertise_host,
        "control_port": control_port,
        "operation_timeout_ms": cfg.operation_timeout_ms,
        "abandon_timeout_ms": cfg.abandon_timeout_ms,
        "eviction_policy": cfg.eviction_policy,
        "nixl_progress_thread": cfg.nixl_progress_thread,
        "progress_idle_ms": cfg.progress_idle_ms,
        "inbound_guard": InboundGuard.from_config(cfg),
    }


@dataclasses.dataclass(frozen=True, slots=True)
class RankDescription:
    """What this rank serves: where it sits, its page layout and the pools."""

    placement: Any  # rank_placement.RankPlacement
    layout: Any  # kvcr_layout.PageLayout
    weights: Any  # model_identity.WeightsTracker
    pools: dict[Any, Any]


def describe_rank(server_args: Any, params: Any, components: Any) -> RankDescription:
    """This rank's description from SGLang's flags and cache params, refusing
    what the linker cannot describe exactly (naming the flag)."""
    from sglang.srt.mem_cache.storage.kvcr.plugin import refuse_unsupported_topology
    from sglang.srt.mem_cache.storage.kvcr.pool_group_layout import pool_group
    from sglang.srt.mem_cache.storage.kvcr.rank_placement import (
        attention_replica,
        placement_of,
    )

    refuse_unsupported_topology(server_args)
    kvcache = params.token_to_kv_pool_allocator.get_kvcache()
    shard_rank, shard_size = attn_rank(params)
    placement = placement_of(
        server_args, shard_rank, shard_size, *attention_replica(server_args)
    )
    identity = kvcache_layout_identity(server_args, shard_rank, shard_size)
    family, group = pool_group(
        kvcache, params, set(components), lambda: draft_pool(params)
    )
    if "draft" in map(str, group.entry_map) and not identity.draft:
        raise KVCRLayoutError(
            f"{family} model: a draft KV pool is present but no "
            "--speculative-draft-model-path names the draft (ModelIdentity.draft)"
        )
    layout = kvcr_layout.PageLayout.from_pool_group(group, identity=identity)
    load_format = str(getattr(server_args, "load_format", None) or "auto")
    weights = model_identity.WeightsTracker(identity, load_format)
    pools = linker_pools(layout, components)
    if "swa" in map(str, pools):
        refuse_virtual_swa_pages(params.token_to_kv_pool_allocator)
    logger.info("KVCR model family %s: pools %s", family, sorted(map(str, pools)))
    return RankDescription(placement, layout, weights, pools)
