"""The ``kvcr`` backend's linker for one rank, and the follower of a replicated group.

``build_linker`` describes the rank once and returns its linker: a
``KVCRDirectLinker`` storing its own pages, or, where the attention group stores
rank-replicated pools once (``replica_broadcast.stores_once``), the owner's
``KVCRDirectLinker`` with a ``ReplicaBroadcast`` on attention-TP rank 0 and a
``ReplicaFollower`` on every other rank. A follower has no KVCR, no DRAM and no
control port; it takes part in every collective the owner does, answering so
that each MIN reduction gives the owner's answer: every restorable length is
offered, every preparation is ready, every offload succeeds (the owner's result
decides), and each load receives its pages through the broadcast. Its stored
marks are indexed and cleared as the owner's are, so the ranks' trees agree.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from sglang.srt.mem_cache.hicache_storage import PoolTransfer
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
)

from sglang.srt.mem_cache.storage.kvcr import rank_setup
from sglang.srt.mem_cache.storage.kvcr.config.linker_config import KVCRLinkerConfig
from sglang.srt.mem_cache.storage.kvcr.datapath.replica_broadcast import (
    ReplicaBroadcast,
)
from sglang.srt.mem_cache.storage.kvcr.observability import linker_stats
from sglang.srt.mem_cache.storage.kvcr.requests.fetch_plan import kv_keys
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
    PreparationHandle,
    PreparationHooks,
    VerdictsPerRequest,
)

logger = logging.getLogger(__name__)


class ReplicaFollower(VerdictsPerRequest, PreparationHooks, UnifiedCacheLinker):
    """A rank whose pages its group's owner stores (see the module docstring)."""

    prepares_requests = True
    publishes_external_events = True

    def __init__(
        self,
        rank: rank_setup.RankDescription,
        broadcast: ReplicaBroadcast,
        config: KVCRLinkerConfig,
        forward_stream: Any = None,
    ) -> None:
        self.config = config
        self.placement, self.layout = rank.placement, rank.layout
        self.pools = rank.pools
        self.broadcast = broadcast
        self.forward_stream = forward_stream
        self.layer_done_counter = LayerWiseLoadCounter(self.layout.num_layers)
        self._results: collections.deque[bool] = collections.deque()
        self._batches: dict[int, tuple[str, ...]] = {}
        self.offloads_acknowledged = 0
        self.loads = 0
        logger.info(
            "KVCR replica follower (%s): stores nothing; global rank %d stores and "
            "restores the pages, this rank receives them by broadcast (digest %s)",
            self.placement.describe(),
            broadcast.src,
            self.layout.compatibility_digest,
        )

    # ---- preparation: the owner's decides ------------------------------------------

    def tail_may_hit(self, rid: str, first_page_hash: str) -> bool:
        return False  # nothing to prepare here: no tail hashed at enqueue

    def prepare_request(
        self, ctx: LinkerRequestContext, transfers: list[PoolTransfer]
    ) -> PreparationHandle:
        return ctx.handle

    def preparation_ready(self, handle: PreparationHandle) -> bool:
        return True

    def release_request(self, rid: str) -> None:
        self.broadcast.cancel(rid)

    def finish_request(self, rid: str) -> None:
        self.release_request(rid)

    def take_removed_page_hashes(self) -> list[str]:
        return []  # the owner announces its evictions; every rank clears them

    # ---- UnifiedCacheLinker contract -------------------------------------------------

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        return list(range(1, len(kv_keys(transfers)) + 1))

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        self.loads += 1
        return self.broadcast.queue(rid, transfers)

    def start_layer_wise_loading(self) -> int:
        index, rids = self.broadcast.receive(self.layer_done_counter)
        if index >= 0:
            self._batches[index] = rids
        return index

    def finish_layer_wise_loading_by_request(
        self, counter_index: int
    ) -> dict[str, bool]:
        """Whether the batch's broadcast landed, per request (the owner's copy is
        judged by its own verdict, MIN-reduced with these)."""
        rids = self._batches.pop(counter_index, None)
        if rids is None:
            return {}
        ok = bool(self.layer_done_counter.finish(counter_index))
        return dict.fromkeys(rids, ok)

    def cancel_queued_load(self, rid: str) -> bool:
        return self.broadcast.cancel(rid)

    def offload(
        self, transfers: list[PoolTransfer], session_id: str | None = None
    ) -> bool:
        self._results.append(True)
        self.offloads_acknowledged += 1
        return True

    def num_completed_offloads(self) -> int:
        return len(self._results)

    def pop_completed_offload(self) -> bool:
        return self._results.popleft()

    def reset(self) -> None:
        self._results.clear()
        self._batches.clear()
        self.broadcast.reset()

    def close(self) -> None:
        self.reset()
        logger.info("%s", self.stats_line())

    # ---- stats -----------------------------------------------------------------

    def claims_held(self) -> int:
        return 0

    def is_quiescent(self) -> bool:
        return not self._batches and not self._results

    def stats_snapshot(self) -> dict[str, Any]:
        """This rank's counters, under the owner's names where they are the
        same figures: it deposits nothing and holds no KVCR DRAM."""
        return {
            "offloads_acknowledged": self.offloads_acknowledged,
            "loads": self.loads,
            "offload_pages": 0,
            "offloaded_bytes": 0,
            "resident_keys": 0,
            "dram_bytes": 0,
            **self.broadcast.stats_snapshot(),
        }

    def stats_line(self) -> str:
        return linker_stats.stats_line(self.stats_snapshot())
