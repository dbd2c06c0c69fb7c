"""A bound on the write-probe fences a kvcr 0.1.1 source keeps (``install``).

When a target probes a write it gave up on (``write_probe``), kvcr's source keeps
a cancellation fence for that (target agent, op handle) until restart, even when
no such write exists, so a ``start_write`` that a reconnect delayed past its
probe is refused instead of writing into slots the target has since reused. Any
admitted peer can send probes for made-up handles, so the fences
(``_DanglingOps.source_writes``) grow without bound. Once installed, a KVCR keeps
at most ``MAX_FENCES`` of them; the oldest is evicted first and leaves a floor
for its target agent and handle sign (kvcr counts fill handles down from minus a
clock seed and delivery handles up from it, so a larger magnitude is a later
operation): a ``start_write`` from that agent for a handle at or below the floor,
with nothing else known of it, is refused exactly as a fence would refuse it.
Floors are kept for ``MAX_FLOOR_AGENTS`` agents (the least recently raised is
forgotten first, counted and logged). A source's live writes are untouched.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import kvcr_internals

logger = logging.getLogger(__name__)

MAX_FENCES = 4096
MAX_FLOOR_AGENTS = 1024
_MISSING = object()
_LOCK = threading.Lock()
_installed = False
_status_cls: Any = None


class FencedWrites(dict[tuple[str, int], Any]):
    """kvcr's ``source_writes`` (write id -> ``_SourceWriteStatus``) with its
    probe fences bounded. kvcr 0.1.1 adds a fence only with ``setdefault``
    (``handle_probe``) and asks for one only with ``get`` (``handle_probe``,
    ``_handle_start_write``); live writes use item access and ``pop``."""

    __slots__ = ("_fences", "_floors", "floors_forgotten")

    def __init__(self) -> None:
        super().__init__()
        self._fences: collections.OrderedDict[tuple[str, int], Any] = (
            collections.OrderedDict()
        )
        # (target agent, handle < 0) -> largest evicted handle magnitude
        self._floors: collections.OrderedDict[tuple[str, bool], int] = (
            collections.OrderedDict()
        )
        self.floors_forgotten = 0

    @property
    def fences(self) -> int:
        return len(self._fences)

    def setdefault(self, key: tuple[str, int], default: Any = None) -> Any:
        found = dict.get(self, key, _MISSING)
        if found is not _MISSING:
            return found
        dict.__setitem__(self, key, default)
        self._fences[key] = default
        while len(self._fences) > MAX_FENCES:
            self._evict()
        return default

    def get(self, key: tuple[str, int], default: Any = None) -> Any:
        found = dict.get(self, key, _MISSING)
        if found is not _MISSING:
            return found
        if self._below_floor(key):
            return _status_cls(cancel_requested=True)  # refused like a fence
        return default

    def _below_floor(self, key: tuple[str, int]) -> bool:
        agent, handle = key
        if type(handle) is not int:
            return False
        floor = self._floors.get((agent, handle < 0))
        return floor is not None and abs(handle) <= floor

    def _evict(self) -> None:
        key, status = self._fences.popitem(last=False)
        if dict.get(self, key) is status:
            dict.__delitem__(self, key)
        agent, handle = key
        if type(handle) is not int:
            return
        side = (agent, handle < 0)
        self._floors[side] = max(self._floors.get(side, 0), abs(handle))
        self._floors.move_to_end(side)
        while len(self._floors) > MAX_FLOOR_AGENTS:
            (forgotten, _), _ = self._floors.popitem(last=False)
            self.floors_forgotten += 1
            logger.warning(
                "KVCR forgot the probe-fence floor of target agent %r (over %d "
                "agents): a start_write from it delayed past its probe is no "
                "longer refused",
                forgotten,
                MAX_FLOOR_AGENTS,
            )


def fences(kv: Any) -> int:
    """Probe fences ``kv`` (a ``kvcr.KVCR``) keeps now."""
    writes = kv._core._remote_fw_dram._dangling_ops.source_writes
    return writes.fences if isinstance(writes, FencedWrites) else len(writes)


def install() -> None:
    """Bound the fences of every KVCR built from now on, once per process;
    raises ``kvcr_internals.KVCRInternalsChanged`` when kvcr is not 0.1.1."""
    global _installed, _status_cls
    with _LOCK:
        if _installed:
            return
        cls, _status_cls = kvcr_internals.dangling_ops_classes()
        original_init = cls.__init__

        def init(self: Any, backend: Any) -> None:
            original_init(self, backend)
            kvcr_internals.require_empty_dict(self.source_writes, "source_writes")
            self.source_writes = FencedWrites()

        cls.__init__ = init
        _installed = True
