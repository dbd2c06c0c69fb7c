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
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from sglang.srt.mem_cache.storage.kvcr.device.host_memory import HostMemory
from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import CapacityPlan
from sglang.srt.mem_cache.storage.kvcr.observability.linker_stats import DramGauges
from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_patches

logger = logging.getLogger(__name__)


class Reclaimable(Protocol):
    """A closed core (``KVCRAdapter``) whose KVCR may still be running."""

    def reclaim(self, timeout_s: float) -> bool:
        """Whether it has proven quiescent and closed since."""
        ...


@dataclasses.dataclass(slots=True)
class _Held:
    core: Reclaimable
    storage: dict[str, torch.Tensor]
    reclaimable: bool = True  # False: something else (a copy) may still use it


# KVCRs whose close failed stay referenced here until the process exits, or until
# they prove quiescent and close (kvcr keeps backend resources alive meanwhile).
_RETAINED: list[Any] = []


class RetainedCore:
    """A KVCR an unclean close left running, asked later whether it has proven
    quiescent (a dead peer's operation resolved, e.g. it restarted on the same
    endpoint). One thread at a time is its only caller; waits are bounded."""

    def __init__(
        self,
        kv: Any,
        name: str,
        *,
        writing: Callable[[], bool] = lambda: False,
        closed: bool = False,
    ) -> None:
        self.kv = kv
        self._name = name
        # A deposit copy the close could not wait for still writes its slots;
        # ``closed``: the KVCR itself closed cleanly (only the copy is awaited).
        self._writing = writing
        self._kv_closed = closed
        self._attempt: threading.Thread | None = None
        self._closed = threading.Event()
        _RETAINED.append(kv)

    def reclaim(self, timeout_s: float) -> bool:
        """Whether it is now quiescent and closed (then it is let go)."""
        attempt = self._attempt
        if attempt is None or (not attempt.is_alive() and not self._closed.is_set()):
            attempt = threading.Thread(
                target=self._main, name=f"{self._name}-reclaim", daemon=True
            )
            self._attempt = attempt
            attempt.start()
        attempt.join(timeout_s)
        if not self._closed.is_set():
            return False
        for i, retained in enumerate(_RETAINED):
            if retained is self.kv:
                del _RETAINED[i]
                break
        return True

    def _main(self) -> None:
        try:
            if self._writing():
                return
            if self._kv_closed or kvcr_patches.core_is_quiescent(self.kv):
                if not self._kv_closed:
                    self.kv.close()
                self._closed.set()
        except Exception:
            logger.debug("KVCR reclaim attempt failed", exc_info=True)


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

    def add(
        self,
        core: Reclaimable,
        storage: dict[str, torch.Tensor],
        reclaimable: bool = True,
    ) -> None:
        """Quarantine ``core`` (closed uncleanly) with the DRAM it may write;
        ``reclaimable=False`` when more than the core may still touch it."""
        for buf in storage.values():
            self._memory.quarantine(buf)
        self._held.append(_Held(core, dict(storage), reclaimable))

    def reclaim(self, timeout_s: float) -> int:
        """Reuse the DRAM of every core that has proven quiescent since; returns
        how many cores were reclaimed (each waits at most ``timeout_s``)."""
        kept, reclaimed = [], 0
        for held in self._held:
            if not held.reclaimable or not held.core.reclaim(timeout_s):
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


class KVCRDram:
    """One rank's KVCR DRAM share per pool, through every flush: zeroed and kept
    after a clean close; after an unclean one quarantined with its core and
    replaced (by reclaimed spare DRAM when there is some). Past
    ``max_cores`` quarantined cores, ``peer_fetches_off`` says peer fetches
    stop; it clears once reclaiming brings the count back under the bound."""

    def __init__(self, memory: HostMemory, plan: CapacityPlan, max_cores: int) -> None:
        self.memory = memory
        self.storage = {pool.name: memory.alloc(pool.bytes) for pool in plan.pools}
        # One whole page of each pool (every part), what a disabled core gets.
        self._page_bytes = {p.name: p.bytes // plan.pages for p in plan.pools}
        self._share_bytes = {p.name: p.bytes for p in plan.pools}
        self.quarantine = Quarantine(memory)
        self.max_cores = max_cores
        self.peer_fetches_off = False
        # Past the bound: KVCR keeps running on one page per pool, restoring and
        # storing nothing, so no later flush can quarantine another share.
        self.disabled = False

    def flush(
        self,
        old_core: Reclaimable,
        clean: bool,
        timeout_s: float,
        reclaimable: bool = True,
    ) -> bool:
        """The core was closed (``clean``: provably quiescent; ``reclaimable``:
        nothing but the core may still touch the DRAM); returns whether the
        storage was replaced (the next core must be given the new regions)."""
        if self.quarantine.cores and self.quarantine.reclaim(timeout_s):
            logger.info(
                "KVCR reset: quarantined cores reclaimed; %d bytes still quarantined",
                self.quarantine.bytes(),
            )
        replaced = not clean
        if replaced:
            # A transfer may still write the old DRAM: quarantine it with its core
            # and give the new KVCR other memory, taken first (all or nothing):
            # a failed allocation leaves the old share where it was, never
            # handed to a next KVCR while also quarantined.
            disabled = self.quarantine.cores + 1 > self.max_cores
            fresh = self._take_all(self._page_bytes if disabled else self._share_bytes)
            self.quarantine.add(old_core, self.storage, reclaimable)
            self._set_disabled(disabled)
            self.storage = fresh
            logger.error(
                "KVCR reset: old core not quiescent; %d bytes quarantined",
                self.quarantine.bytes(),
            )
        elif self.disabled and self.quarantine.cores <= self.max_cores:
            # Reclaimed back under the bound: a full share again.
            fresh = self._take_all(self._share_bytes)
            for buf in self.storage.values():
                self.memory.release(buf)
            self.storage = fresh
            self._set_disabled(False)
            replaced = True
        else:
            for storage in self.storage.values():
                storage.zero_()
        over = self.quarantine.cores >= self.max_cores and (
            self.quarantine.cores > 0 or (self.max_cores == 0 and self.peer_fetches_off)
        )  # 0: off for good at the first quarantine
        if over and not self.peer_fetches_off:
            logger.error(
                "KVCR: %d bytes quarantined (max_quarantined_cores=%d reached); "
                "peer fetches are off until a flush finds a quarantined core "
                "quiescent again; local offload and restore continue",
                self.quarantine.bytes(),
                self.max_cores,
            )
        elif self.peer_fetches_off and not over:
            logger.info("KVCR: quarantine back under its bound; peer fetches are on")
        self.peer_fetches_off = over
        return replaced

    def _take_all(self, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        """A buffer per pool, or none: what was taken goes back on a failure."""
        taken: dict[str, torch.Tensor] = {}
        try:
            for name in self.storage:
                taken[name] = self.quarantine.take(name, sizes[name])
        except BaseException:
            for buf in taken.values():
                self.memory.release(buf)  # fresh or a proven-idle spare
            raise
        return taken

    def gauges(self) -> DramGauges:
        """This share's figures for the stats snapshot."""
        return DramGauges(
            peer_fetches_off=self.peer_fetches_off,
            quarantined_bytes=self.quarantine.bytes(),
            pinned_bytes=self.memory.pinned_bytes,
            dram_bytes=sum(t.nbytes for t in self.storage.values()),
        )

    def _set_disabled(self, disabled: bool) -> None:
        if disabled and not self.disabled:
            logger.error(
                "KVCR: more than max_quarantined_cores=%d DRAM shares quarantined; "
                "the KVCR linker restores and stores nothing until a flush finds "
                "them quiescent (this worker recomputes)",
                self.max_cores,
            )
        elif self.disabled and not disabled:
            logger.info("KVCR: quarantined DRAM reclaimed; the linker works again")
        self.disabled = disabled

    def close(self, quiet: bool, extra: list[torch.Tensor]) -> None:
        """Unlock the DRAM (and ``extra`` buffers) when nothing can touch it any
        more; else keep it for the process's life."""
        for buf in [*self.storage.values(), *extra]:
            if quiet:
                self.memory.release(buf)
            else:
                self.memory.quarantine(buf)
