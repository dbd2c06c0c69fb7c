"""The one place a rank's linker is built: config parsed once, the rank described once.

``build_linker`` parses the KVCR config, describes the rank (``rank_setup``) and
returns its linker: a ``KVCRDirectLinker`` storing its own pages, or, where the
attention group stores rank-replicated pools once (``replica_broadcast.stores_once``),
the owner's ``KVCRDirectLinker`` with a ``ReplicaBroadcast`` on attention-TP rank 0
and a ``ReplicaFollower`` on every other rank.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
)

from sglang.srt.mem_cache.storage.kvcr import rank_setup
from sglang.srt.mem_cache.storage.kvcr.config.linker_config import KVCRLinkerConfig
from sglang.srt.mem_cache.storage.kvcr.datapath.replica_broadcast import (
    NO_REPLICAS,
    NoReplicas,
    ReplicaBroadcast,
    broadcast_group,
    dest_rows_of,
    dram_ranks,
    stores_once,
)
from sglang.srt.mem_cache.storage.kvcr.device.device_streams import DeviceBinding
from sglang.srt.mem_cache.storage.kvcr.kvcr_direct_linker import KVCRDirectLinker
from sglang.srt.mem_cache.storage.kvcr.owner.gil_share import share_gil
from sglang.srt.mem_cache.storage.kvcr.replica_follower import ReplicaFollower

logger = logging.getLogger(__name__)


def build_linker(
    server_args: Any,
    params: Any,
    *,
    components: Any,
    extra_config: dict[str, Any] | None,
    forward_stream: Any = None,
) -> UnifiedCacheLinker:
    """This rank's linker (see the module docstring); once it is built, the
    process's GIL switch interval is lowered (``owner.gil_share``) and SGLang's
    page hashing is loaded (``_warm_page_hashing``)."""
    config = KVCRLinkerConfig.from_dict(extra_config or {})  # every rank refuses alike
    linker = _build(server_args, params, components, config, forward_stream)
    share_gil(config.gil_switch_interval_us)  # once nothing can refuse any more
    _warm_page_hashing()  # not on the first request's insert
    return linker


def _build(
    server_args: Any,
    params: Any,
    components: Any,
    config: KVCRLinkerConfig,
    forward_stream: Any,
) -> UnifiedCacheLinker:
    rank = rank_setup.describe_rank(server_args, params, components)
    placement, layout = rank.placement, rank.layout
    page_size = int(params.page_size)
    replicas: ReplicaBroadcast | NoReplicas = NO_REPLICAS
    if stores_once(layout, placement.shard_size):
        group, owner = broadcast_group(params, layout)
        is_owner = placement.shard_rank == 0
        replicas = ReplicaBroadcast(
            layout,
            dest_rows_of(layout, page_size),
            group,
            owner,
            is_owner,
            page_size,
            forward_stream,
        )
        if not is_owner:
            return ReplicaFollower(rank, replicas, config, forward_stream)
        logger.info(
            "KVCR rank-replicated pools stored once: this rank (global %d) stores "
            "and restores them for its %d attention ranks",
            owner,
            placement.shard_size,
        )
    # The rank's device, captured here on the scheduler thread: side threads
    # start on device 0 and bind to it before touching CUDA.
    device = DeviceBinding.of(layout.pools[0].tensors[0].device)
    # Registered before anything starts: a refusal here leaves nothing running.
    counter = LayerWiseLoadCounter(layout.num_layers)
    rank_setup.register_state_counter(params, layout, counter)
    sharers = dram_ranks(placement, replicas is not NO_REPLICAS)
    resources = rank_setup.build_resources(layout, config, sharers, device, page_size)
    setup = rank_setup.LinkerSetup(
        config=config,
        rank=rank,
        resources=resources,
        device=device,
        counter=counter,
        server_args=server_args,
        page_size=page_size,
        replicas=replicas,
        forward_stream=forward_stream,
    )
    return KVCRDirectLinker(setup)  # owns the resources from here on


def _warm_page_hashing() -> None:
    """Load SGLang's native page-hash extension now. With a linker, an insert
    hashes its pages through it, and it is built (a C++ compile on a fresh host)
    and loaded on first use, which the first request after start-up would
    otherwise wait for. A failure is logged and changes nothing:
    the first insert tries again, as it would have."""
    try:
        from sglang.srt.mem_cache.utils import get_hash_str

        get_hash_str([1])
    except Exception as exc:
        logger.warning(
            "KVCR linker: SGLang's native page hash did not load at start-up (the "
            "first insert retries it): %s",
            exc,
        )
