"""Keeps KVCR's long-lived per-page objects out of Python's full collections.

kvcr holds several tracked Python objects per resident page (block record,
residency, slot list, eviction-queue entry), created long after SGLang's
post-warmup ``gc.freeze()``. Every full collection in the scheduler process
walks them all: with a 256 MiB DRAM of 65,536 small pages that is a 23-111 ms
stop of the scheduler, each time a quarter more objects have survived.
``IdleFreezer`` moves them out of the collector's reach the way SGLang's own
warmup does, but only where that leaks nothing: on a fully idle scheduler pass
(no request waiting or running, no deposit or preparation in flight), once at
least ``gc_freeze_pages`` pages have been offloaded or prepared since the last
freeze, it runs one full collection (which walks only what is not frozen:
about what those pages added, the whole heap after a thaw) and then
``gc.freeze()``. Garbage cycles are collected before they could be frozen, and
nothing is frozen while SGLang holds requests of a session
(``sglang_hooks.session_pins``: a closed session is cyclic garbage). kvcr's
page objects form no cycles, so an evicted page's objects are still freed by
reference counting while frozen. Under load with no idle pass nothing is frozen
and full collections are what they were. A flush, a KVCR restart and close
``thaw`` it all back: the old core's objects may hold cycles that only a
collection frees.
"""

from __future__ import annotations

import gc
import logging
import time

from sglang.srt.mem_cache.storage.kvcr.observability.linker_stats import LinkerStats

logger = logging.getLogger(__name__)

# Whether a freezer of this process froze since the last thaw (gc.freeze and
# gc.unfreeze act on the whole process, whichever linker calls them).
_FROZEN = [False]


class IdleFreezer:
    """``maybe_freeze(pages_seen)`` on each fully idle, quiet scheduler pass."""

    __slots__ = ("_mark", "every_pages", "stats")

    def __init__(self, every_pages: int, stats: LinkerStats) -> None:
        self.every_pages = every_pages  # 0: never freeze
        self._mark = 0  # pages_seen at the last freeze
        self.stats = stats  # gc_freezes, gc_collected, gc_freeze_ms_*

    def due(self, pages_seen: int) -> bool:
        """Whether enough pages came since the last freeze (one comparison)."""
        return 0 < self.every_pages <= pages_seen - self._mark

    def thaw(self) -> None:
        """Give every frozen object back to the collector, after a flush, a KVCR
        restart or at close: the old core's objects may hold cycles (threads,
        callbacks) that only a collection frees, and with them its memory.
        SGLang's warmup-frozen objects go back too, so whichever comes first of
        the next automatic full collection and the next idle freeze walks the
        whole heap (0.6 s with 1.2 million objects). Nothing if no freezer of
        this process froze since the last thaw."""
        if not _FROZEN[0]:
            return
        gc.unfreeze()
        _FROZEN[0] = False
        self._mark = -self.every_pages  # due at the next quiet idle pass

    def maybe_freeze(self, pages_seen: int) -> bool:
        """Collect, then freeze the survivors, when due; whether it froze."""
        if not self.due(pages_seen):
            return False
        start = time.perf_counter()
        collected = gc.collect()
        gc.freeze()  # O(1); gc.get_freeze_count() would walk every frozen object
        elapsed_ms = (time.perf_counter() - start) * 1e3
        since, self._mark = pages_seen - self._mark, pages_seen
        _FROZEN[0] = True
        s = self.stats
        s.gc_freezes += 1
        s.gc_collected += collected
        s.gc_freeze_ms_total += elapsed_ms
        s.gc_freeze_ms_max = max(s.gc_freeze_ms_max, elapsed_ms)
        logger.debug(
            "KVCR idle freeze in %.2f ms (%d pages since the last, %d objects of "
            "garbage collected first)",
            elapsed_ms,
            since,
            collected,
        )
        return True
