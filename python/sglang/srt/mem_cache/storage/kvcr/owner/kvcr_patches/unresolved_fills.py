"""KVCR DRAM still held by failed peer fetches, counted (kvcr 0.1.1, ``install``).

A fetch from a peer that accepts a ``start_write`` and never completes it (or
where nothing listens: ZMQ still queues the message) fails its caller at the
operation deadline, but kvcr keeps the destination slots (``DISCARDING``) until
the source proves its write quiesced, which may be never: repeated, such hints
pin the whole DRAM share while the linker, whose fetch already failed, no longer
counts them. Once installed, a core tallies the bytes of every fill it discards
(``_discard_local_dram_fill``) until the fill completes either way
(``_complete_local_dram_fill``), on the owner thread that runs both; ``held``
reads it, and the linker takes no more hints while it is over its bound.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import kvcr_internals

_ATTR = "_sglang_unresolved_fills"
_LOCK = threading.Lock()
_installed = False


@dataclasses.dataclass(slots=True)
class FillTally:
    """Discarded fills of one core: key -> bytes of its slots, and their sum."""

    keys: dict[Any, int] = dataclasses.field(default_factory=dict)
    bytes: int = 0


def _tally(core: Any) -> FillTally:
    tally = core.__dict__.get(_ATTR)
    if tally is None:
        tally = core.__dict__[_ATTR] = FillTally()
    return tally


def held(kv: Any) -> int:
    """Bytes of KVCR DRAM ``kv`` (a ``kvcr.KVCR``) holds for fills it discarded."""
    tally = getattr(getattr(kv, "_core", None), "__dict__", {}).get(_ATTR)
    return 0 if tally is None else int(tally.bytes)


def install() -> None:
    """Tally the discarded fills of every core, once per process; raises
    ``kvcr_internals.KVCRInternalsChanged`` when kvcr is not 0.1.1."""
    global _installed
    with _LOCK:
        if _installed:
            return
        cls = kvcr_internals.core_class()
        from kvcr.local_dram import _LocalDramState

        original_discard = cls._discard_local_dram_fill
        original_complete = cls._complete_local_dram_fill

        def discard(self: Any, keys: Any) -> None:
            keys = tuple(keys)
            original_discard(self, keys)
            tally = _tally(self)
            for key in keys:
                record = self._block_record_map.get(key)
                residency = None if record is None else record.local_dram
                if (
                    key in tally.keys
                    or residency is None
                    or residency.state is not _LocalDramState.DISCARDING
                ):
                    continue
                sizes = self._block_sizes
                n = sum(
                    sizes.get(label.partition(":")[0], 0)
                    for label, _ in residency.slots
                )
                tally.keys[key] = n
                tally.bytes += n

        def complete(self: Any, keys: Any, *, success: bool) -> None:
            keys = tuple(keys)
            original_complete(self, keys, success=success)
            tally = _tally(self)
            for key in keys:
                tally.bytes -= tally.keys.pop(key, 0)

        cls._discard_local_dram_fill = discard
        cls._complete_local_dram_fill = complete
        _installed = True
