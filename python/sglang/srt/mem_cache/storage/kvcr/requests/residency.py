"""What this rank's KVCR holds: a mirror fed by its inventory events.

KVCR reports every key it adds or evicts (``InventoryChange``, drained on the
scheduler thread). ``Residency`` keeps the set of resident keys, answers whether a
page is whole in a set of pools, and collects the page hashes of evictions for the
stored-mark hook (``take_removed``): a page with any object evicted, in any pool
(kv, draft, a second KV pool, swa), is no longer whole in KVCR, so its node must be
offloaded again. It also sums the bytes of the resident objects (each key's
pool, its last field, gives its size). A flush starts it empty, under the new
layout's keys.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import PageLayout
from sglang.srt.mem_cache.storage.kvcr.observability.linker_stats import (
    ResidencyGauges,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import InventoryChange


class Residency:
    """Resident KVCR keys of one rank and the pages evicted since last taken."""

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout
        self._keys: set[bytes] = set()
        self._removed: list[str] = []
        self.bytes = 0  # bytes of the resident objects (every part of each)
        self._sizes = _object_sizes(layout)

    def __len__(self) -> int:
        return len(self._keys)

    def gauges(self) -> ResidencyGauges:
        """What KVCR holds, for the stats snapshot."""
        return ResidencyGauges(
            resident_keys=len(self._keys), dram_used_bytes=self.bytes
        )

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def parse_key(self, key: bytes) -> tuple[str, str] | None:
        """(page hash, pool) of one of our keys; None for anything else."""
        return self.layout.parse_block_key(key)

    def holds(self, page_hash: str, pools: tuple[Any, ...]) -> bool:
        """Whether every pool of ``pools`` holds ``page_hash``'s object."""
        keys, block_key = self._keys, self.layout.block_key
        # A loop, not all(): no generator per call (this runs for every page).
        for pool in pools:  # noqa: SIM110
            if block_key(page_hash, pool.name) not in keys:
                return False
        return True

    def on_inventory(self, change: InventoryChange) -> int:
        """Apply one inventory change; returns how many pages it evicted."""
        if not change.removed:
            added = [k for k in change.keys if k not in self._keys]
            self._keys.update(added)
            self.bytes += sum(map(self._size, added))
            return 0
        gone = [k for k in change.keys if k in self._keys]
        self._keys.difference_update(gone)
        self.bytes -= sum(map(self._size, gone))
        pages = {
            parsed[0]
            for parsed in map(self.parse_key, change.keys)
            if parsed is not None
        }
        self._removed.extend(sorted(pages))
        return len(pages)

    def take_removed(self) -> list[str]:
        removed, self._removed = self._removed, []
        return removed

    def drop_all(self) -> None:
        """KVCR lost everything (a restart): every resident page is reported
        removed (``take_removed``), and nothing is resident any more."""
        pages = {p[0] for p in map(self.parse_key, self._keys) if p is not None}
        self._removed.extend(sorted(pages))
        self._keys.clear()
        self.bytes = 0

    def reset(self, layout: PageLayout) -> None:
        """Empty, keyed by ``layout`` (a flush rebuilt KVCR)."""
        self.layout = layout
        self._keys.clear()
        self._removed.clear()
        self.bytes = 0
        self._sizes = _object_sizes(layout)

    def _size(self, key: bytes) -> int:
        """Bytes of one key's object: its pool is the key's last ``#`` field."""
        return self._sizes.get(key.rpartition(b"#")[2], 0)


def _object_sizes(layout: PageLayout) -> dict[bytes, int]:
    return {name.encode(): n for name, n in layout.object_bytes.items()}
