"""What a rank's linker is built from: its description, its resources, its setup.

``describe_rank`` reads SGLang's flags and cache params once: the attention rank
and group size, the model identity a page's digest covers, the one draft KV pool
(if any), the model family and its ``DevicePoolGroup`` (``pool_group_layout``),
whose entries are the pools the wrapper hands the linker, refusing (through
``config.startup_checks`` and ``layout.pool_checks``) what it cannot describe
exactly. ``build_resources`` takes the rank's KVCR DRAM share, the span restorer
and the staging area, all or nothing. ``LinkerSetup`` is what ``builder`` hands
a ``KVCRDirectLinker``: the parsed config, the description and the resources.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch

from sglang.srt.mem_cache.storage.kvcr.config.linker_config import KVCRLinkerConfig
from sglang.srt.mem_cache.storage.kvcr.config.startup_checks import (
    refuse_unsupported_topology,
)
from sglang.srt.mem_cache.storage.kvcr.datapath.device_pages import page_rows
from sglang.srt.mem_cache.storage.kvcr.datapath.dram_copy import DramCopier
from sglang.srt.mem_cache.storage.kvcr.datapath.offload_staging import HostStaging
from sglang.srt.mem_cache.storage.kvcr.datapath.span_restore import SpanRestore
from sglang.srt.mem_cache.storage.kvcr.device.device_streams import DeviceBinding
from sglang.srt.mem_cache.storage.kvcr.device.host_memory import HostMemory
from sglang.srt.mem_cache.storage.kvcr.layout.model_dtype import served_dtype
from sglang.srt.mem_cache.storage.kvcr.layout.model_identity import (
    WeightsTracker,
    model_identity_fields,
)
from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import (
    PageLayout,
    plan_capacity,
)
from sglang.srt.mem_cache.storage.kvcr.layout.pool_checks import (
    draft_pool,
    linker_pools,
    refuse_virtual_swa_pages,
)
from sglang.srt.mem_cache.storage.kvcr.layout.pool_group_layout import pool_group
from sglang.srt.mem_cache.storage.kvcr.layout.pool_layout import (
    KVCRLayoutError,
    ModelIdentity,
)
from sglang.srt.mem_cache.storage.kvcr.layout.rank_placement import (
    RankPlacement,
    attention_replica,
    placement_of,
)
from sglang.srt.mem_cache.storage.kvcr.owner.quarantine import KVCRDram

if TYPE_CHECKING:
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
        LayerWiseLoadCounter,
    )

    from sglang.srt.mem_cache.storage.kvcr.datapath.replica_broadcast import (
        NoReplicas,
        ReplicaBroadcast,
    )
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_adapter import KVCRAdapter

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
    server_args: Any, rank: int, size: int, device: Any = None
) -> ModelIdentity:
    """The model identity a page's compatibility digest covers (model_identity),
    with the dtype the model computes in on ``device``, the KV pools' device
    (model_dtype)."""
    fields = model_identity_fields(server_args, served_dtype(server_args, device))
    return ModelIdentity(tp_rank=rank, tp_size=size, **fields)


def register_state_counter(params: Any, layout: PageLayout, counter: Any) -> None:
    """Mamba state is read through the request pool, which waits on the layer
    counter only once it is registered there (as Mooncake does)."""
    if any(p.indices_from == "mamba" for p in layout.pools):
        params.req_to_token_pool.register_layer_transfer_counter(counter)


@dataclasses.dataclass(slots=True)
class RankResources:
    """Host memory and copy machinery one rank's linker owns."""

    dram: KVCRDram
    span: SpanRestore | None  # on CUDA hosts
    staging: HostStaging | None  # on the staged offload path
    dest_rows: dict[str, list[torch.Tensor]]  # per pool, each part's page rows
    copier: DramCopier  # fills every deposit's KVCR DRAM slots (one copy)

    def release(self, timeout_s: float, adapter: KVCRAdapter | None = None) -> None:
        """Give everything back after a start-up that failed: at once when no
        KVCR ran (``adapter`` None), else once the adapter's KVCR has stopped
        (DRAM it may still touch stays locked for the process's life)."""
        staging = [] if self.staging is None else list(self.staging.buffers.values())
        if self.staging is not None:
            self.staging.close(timeout_s)
        if adapter is None:
            self.copier.close(timeout_s)
            self.dram.memory.release_all()
        else:
            quiet = adapter.close()  # its copy ops end before the copier stops
            self.dram.close(self.copier.close(timeout_s) and quiet, staging)


def build_resources(
    layout: PageLayout,
    cfg: KVCRLinkerConfig,
    ranks_on_node: int,
    device: DeviceBinding,
    page_size: int,
) -> RankResources:
    """This rank's KVCR DRAM share (locked on GPU hosts, so restores are
    asynchronous), the span restorer and the staging area, all or nothing."""
    plan = plan_capacity(layout, cfg.local_dram_bytes_per_worker, ranks_on_node)
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
    staging: HostStaging | None = None
    try:
        dram = KVCRDram(memory, plan, cfg.max_quarantined_cores)
        span = None
        if device.is_cuda:  # sized now: no page outgrows it while restoring
            sizes = [(len(p.tensors), p.page_bytes) for p in layout.pools]
            span = SpanRestore(device.device, memory, SpanRestore.scratch_for(sizes))
        if cfg.offload_path == "staged":
            cap = cfg.max_inflight_offload_bytes // layout.page_total
            staging = HostStaging(
                layout.pools,
                dest_rows,
                max(1, min(cap, 1 << 16)),
                memory=memory,
                device=device,
            )
        # What deposits read: the staging area's rows, else the pools'.
        rows = dest_rows if staging is None else staging.part_rows()
        copier = DramCopier(dict(rows), lambda: dram.storage, device)
    except BaseException:
        if staging is not None:
            staging.close(cfg.owner_wait_timeout_s)
        memory.release_all()  # nothing has used them yet
        raise
    return RankResources(dram, span, staging, dest_rows, copier)


@dataclasses.dataclass(frozen=True, slots=True)
class RankDescription:
    """What this rank serves: where it sits, its page layout and the pools."""

    placement: RankPlacement
    layout: PageLayout
    weights: WeightsTracker
    pools: dict[Any, Any]  # SGLang's ``linker.pools``: entry name -> pool


def describe_rank(server_args: Any, params: Any, components: Any) -> RankDescription:
    """This rank's description from SGLang's flags and cache params, refusing
    what the linker cannot describe exactly (naming the flag)."""
    refuse_unsupported_topology(server_args)
    kvcache = params.token_to_kv_pool_allocator.get_kvcache()
    shard_rank, shard_size = attn_rank(params)
    placement = placement_of(
        server_args, shard_rank, shard_size, *attention_replica(server_args)
    )
    identity = kvcache_layout_identity(
        server_args, shard_rank, shard_size, getattr(kvcache, "device", None)
    )
    family, group = pool_group(
        kvcache, params, set(components), lambda: draft_pool(params)
    )
    if "draft" in map(str, group.entry_map) and not identity.draft:
        raise KVCRLayoutError(
            f"{family} model: a draft KV pool is present but no "
            "--speculative-draft-model-path names the draft (ModelIdentity.draft)"
        )
    layout = PageLayout.from_pool_group(group, identity=identity)
    load_format = str(getattr(server_args, "load_format", None) or "auto")
    weights = WeightsTracker(identity, load_format)
    pools = linker_pools(layout, components)
    if "swa" in map(str, pools):
        refuse_virtual_swa_pages(params.token_to_kv_pool_allocator)
    logger.info("KVCR model family %s: pools %s", family, sorted(map(str, pools)))
    return RankDescription(placement, layout, weights, pools)


@dataclasses.dataclass(frozen=True, slots=True)
class LinkerSetup:
    """Everything ``builder.build_linker`` hands a ``KVCRDirectLinker``, built
    once: the linker owns ``resources`` from here on (and gives them back if its
    own start fails)."""

    config: KVCRLinkerConfig
    rank: RankDescription
    resources: RankResources
    device: DeviceBinding  # the rank's device, captured on the scheduler thread
    counter: LayerWiseLoadCounter  # already registered where SGLang waits on it
    server_args: Any  # SGLang's ServerArgs (the metrics' labels)
    page_size: int
    replicas: ReplicaBroadcast | NoReplicas
    forward_stream: Any = None  # SGLang's forward stream (None on CPU)
