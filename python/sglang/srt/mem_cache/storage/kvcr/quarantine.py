"""KVCR cores that could not prove quiescence, the DRAM they hold, and its reuse.

A flush rebuilds KVCR. When the old core's close cannot prove that no transfer
still writes its DRAM (kvcr 0.1.1 keeps a dead peer's operation unresolved), that
DRAM is quarantined with its core and the new core gets other memory. The bound
(``max_quarantined_cores``) is the linker's to enforce; this module keeps the
cores, counts their bytes, and on every flush asks each quarantined core whether
it has since proven quiescent (it has, for example, once the dead peer restarted
on the same endpoint). A core that has is closed and its DRAM, still page-locked,
becomes a spare that the next core of the same size reuses instead of allocating
and registering new memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from sglang.srt.mem_cache.storage.kvcr.host_memory import HostMemory


@dataclasses.dataclass(slots=True)
class _Held:
    core: Any  # a closed KVCRAdapter whose KVCR may still be running
    storage: dict[str, torch.Tensor]


class Quarantine:
    """Quarantined cores and reclaimed spare DRAM, per KVCR pool name."""

    def __init__(self, memory: HostMemory) -> None:
        self._memory = memory
        self._held: list[_Held] = []
        self._spare: dict[str, list[torch.Tensor]] = {}

    @property
    def cores(self) -> int:
        return len(self._held)

    def bytes(self) -> int:
        return sum(t.numel() for h in self._held for t in h.storage.values())

    def add(self, core: Any, storage: dict[str, torch.Tensor]) -> None:
        """Quarantine ``core`` (closed uncleanly) with the DRAM it may write."""
        for buf in storage.values():
            self._memory.quarantine(buf)
        self._held.append(_Held(core, dict(storage)))

    def reclaim(self, timeout_s: float) -> int:
        """Reuse the DRAM of every core that has proven quiescent since; returns
        how many cores were reclaimed (each waits at most ``timeout_s``)."""
        kept, reclaimed = [], 0
        for held in self._held:
            if not held.core.reclaim(timeout_s):
                kept.append(held)
                continue
            reclaimed += 1
            for name, buf in held.storage.items():
                self._memory.reclaim(buf)
                self._spare.setdefault(name, []).append(buf)
        self._held = kept
        return reclaimed

    def take(self, name: str, nbytes: int) -> torch.Tensor:
        """Zeroed DRAM of ``nbytes`` for pool ``name``: a spare when one fits."""
        spares = self._spare.get(name, [])
        for i, buf in enumerate(spares):
            if buf.numel() == nbytes:
                del spares[i]
                return buf.zero_()
        return self._memory.alloc(nbytes)
