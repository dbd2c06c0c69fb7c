"""Host staging for offloads: device pages -> pinned host slots -> KVCR deposit.

NIXL's same-agent VRAM route is slow, so for GPU pools the linker registers a
pinned host staging area with KVCR instead of the device buffers. An offload takes
free staging slots (none free: the offload fails at once, counted as backpressure),
a stager thread waits for the offload-ready events, copies the pages device-to-host
on its own stream, and only then submits the ``Deposit``; the slots return to the
free list when the deposit completes. The staging area holds
``max_inflight_offload_bytes`` worth of pages, which bounds in-flight offload
memory. The stager never calls KVCR: it hands the deposit to the adapter's queue.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class StageJob:
    """Per pool, copy device pages into staging slots (same order), then run
    ``submit``. ``copies``: ``(pool name, device pages, slots)``."""

    copies: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]
    events: tuple[Any, ...]
    submit: Callable[[], None]
    fail: Callable[[BaseException], None]


class HostStaging:
    """Pinned staging slots, one ``(parts, pages, page_bytes)`` tensor per pool."""

    def __init__(
        self,
        pools: Sequence[Any],
        sources: dict[str, list[torch.Tensor]],
        pages: int,
        *,
        pin: bool,
    ) -> None:
        self.pages = pages
        self._pools = list(pools)
        self._sources = sources  # pool name -> per-part device rows (page, bytes)
        self.buffers = {
            p.name: torch.zeros(
                (len(p.spans), pages, p.page_bytes), dtype=torch.uint8, pin_memory=pin
            )
            for p in self._pools
        }
        self._free: collections.deque[int] = collections.deque(range(pages))
        self._jobs: queue.SimpleQueue[StageJob | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name="kvcr-stager", daemon=True
        )
        self._thread.start()

    def region_descriptors(self) -> list[Any]:
        """KVCR framework regions over the staging area (DRAM), labelled per part."""
        from kvcr.types import RegionDescriptor

        regions = []
        for pool in self._pools:
            buf = self.buffers[pool.name]
            for part, label in enumerate(pool.part_labels):
                regions.append(
                    RegionDescriptor(
                        mem_type="DRAM",
                        addr=buf[part].data_ptr(),
                        size=pool.page_bytes,
                        count=self.pages,
                        label=label,
                    )
                )
        return regions

    def memory_refs(self, agent: str, pool: Any, slot: int) -> list[Any]:
        from kvcr.types import MemoryRef

        return [
            MemoryRef(end_point_name=agent, label=label, element_index=slot)
            for label in pool.part_labels
        ]

    def alloc(self, n: int) -> tuple[int, ...] | None:
        """``n`` free slots, or None (the offload fails: backpressure)."""
        if n > len(self._free):
            return None
        return tuple(self._free.popleft() for _ in range(n))

    def free(self, slots: Sequence[int]) -> None:
        self._free.extend(slots)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def stage(self, job: StageJob) -> None:
        self._jobs.put(job)

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until every queued copy has been handed on; False at the deadline."""
        done = threading.Event()
        self._jobs.put(StageJob((), (), submit=done.set, fail=lambda exc: done.set()))
        return done.wait(timeout_s)

    def close(self, timeout_s: float) -> None:
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                for event in job.events:
                    event.synchronize()
                if job.copies:
                    self._copy(job, stream)
            except BaseException as exc:
                logger.exception("KVCR offload staging copy failed")
                job.fail(exc)
                continue
            try:
                job.submit()
            except Exception:
                logger.exception("KVCR offload could not be submitted")

    def _copy(self, job: StageJob, stream: Any) -> None:
        for name, device_pages, slot_list in job.copies:
            if not device_pages:
                continue
            pages = torch.tensor(device_pages, dtype=torch.long)
            slots = torch.tensor(slot_list, dtype=torch.long)
            staged = self.buffers[name]
            for part, rows in enumerate(self._sources[name]):
                if stream is not None and rows.is_cuda:
                    with torch.cuda.stream(stream):
                        picked = rows.index_select(0, pages.to(rows.device))
                        staged[part].index_copy_(
                            0, slots, picked.to("cpu", non_blocking=True)
                        )
                else:
                    staged[part].index_copy_(0, slots, rows.index_select(0, pages))
        if stream is not None:
            stream.synchronize()
