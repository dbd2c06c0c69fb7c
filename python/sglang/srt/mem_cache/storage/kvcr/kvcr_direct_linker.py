"""KVCRDirectLinker: placeholder that validates its config and reports no hits.

Replaced by the real KVCR-backed linker; kept minimal so the plugin route can be
exercised end to end on a CPU server.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.storage.kvcr.config import KVCRLinkerConfig
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
)

logger = logging.getLogger(__name__)


class KVCRDirectLinker(UnifiedCacheLinker):
    """Placeholder linker: every lookup misses and every offload fails."""

    def __init__(
        self,
        server_args: Any,
        params: Any,
        *,
        components: Any,
        extra_config: dict[str, Any] | None = None,
        forward_stream: Any = None,
    ) -> None:
        self.config = KVCRLinkerConfig.from_dict(extra_config or {})
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.forward_stream = forward_stream
        self.pools = {PoolName.KV: kvcache}
        self.layer_done_counter = LayerWiseLoadCounter(kvcache.layer_num)
        self._offload_results: collections.deque[bool] = collections.deque()
        logger.info("KVCRDirectLinker placeholder active: no external hits")

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        return []

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        return False

    def start_layer_wise_loading(self) -> int:
        return -1

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        return False

    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        self._offload_results.append(False)
        return True

    def num_completed_offloads(self) -> int:
        return len(self._offload_results)

    def pop_completed_offload(self) -> bool:
        return self._offload_results.popleft()

    def reset(self) -> None:
        self._offload_results.clear()

    def close(self) -> None:
        self._offload_results.clear()
