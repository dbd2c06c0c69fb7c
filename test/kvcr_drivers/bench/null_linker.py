"""A linker that stores and finds nothing: SGLang's linker mode, minus a backend.

The serving bench starts one server with it (SGLang's ``dynamic`` linker backend,
on the Python radix tree core the kvcr plugin also selects), so every run
separates what SGLang's linker mode itself costs a cold request (the lookup's
match and per-page hashes at scheduling time, the write-through bookkeeping)
from what the kvcr linker adds over it (its enqueue-time preparation among
them). Every offload completes at once as stored, the way a successful
write-through completes for SGLang; every lookup is a miss, so no load is ever
started. It has no layer counter (SGLang then skips the per-layer waits a
loading linker's counter answers at once; a few calls per forward). Bench only:
it is never installed with the package.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinker


def launch_config() -> dict[str, str]:
    """``--unified-cache-external-linker-config`` selecting this linker."""
    return {"linker_module_path": __name__, "linker": NullLinker.__name__}


class NullLinker(UnifiedCacheLinker):
    def __init__(
        self,
        server_args: Any,
        params: Any,
        *,
        components: Any,
        extra_config: dict[str, Any],
        forward_stream: Any = None,
    ) -> None:
        self.forward_stream = forward_stream
        self.layer_done_counter = None
        self.pools = {}
        self._completed: deque[bool] = deque()

    def lookup(self, rid: str, transfers: list[Any]) -> list[int]:
        return []

    def load(self, rid: str, transfers: list[Any]) -> bool:
        return False

    def start_layer_wise_loading(self) -> int:
        return -1  # SGLang's "no load in flight"

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        return False

    def offload(self, transfers: list[Any], session_id: str | None = None) -> bool:
        self._completed.append(True)
        return True

    def num_completed_offloads(self) -> int:
        return len(self._completed)

    def pop_completed_offload(self) -> bool:
        return self._completed.popleft()

    def reset(self) -> None:
        self._completed.clear()

    def close(self) -> None:
        self._completed.clear()
