"""Host staging for offloads (``offload_path = "staged"``): device pages -> pinned
host slots -> KVCR deposit, whose copier reads the staging slots.

The explicit two-copy path, kept for comparison and for hosts where reading the
pools from a side thread after the offload's fences is not wanted. An offload takes
free staging slots (none free: the offload fails at once, counted as backpressure),
a stager thread (bound to the pools' device) orders its own stream after the
offload-ready events, gathers each part's pages on the device into a bounded
scratch buffer, copies them asynchronously into the page-locked slots, drains the
stream, and only then submits the ``Deposit``: KVCR never reads a slot whose copy
is still in flight. The slots return to the free list when the deposit completes. The staging area holds
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

from sglang.srt.mem_cache.storage.kvcr.device.device_streams import (
    DeviceBinding,
    drain,
    wait_fences,
)
from sglang.srt.mem_cache.storage.kvcr.device.host_memory import HostMemory

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class StageJob:
    """Per pool, copy device pages into staging slots (same order), then run
    ``submit``. ``copies``: ``(pool name, device page index tensor, slots)``; the
    index tensor lives on the pools' device (no host sync to build it)."""

    copies: tuple[tuple[str, torch.Tensor, tuple[int, ...]], ...]
    events: tuple[Any, ...]
    submit: Callable[[], None]
    fail: Callable[[BaseException], None]


class HostStaging:
    """Page-locked staging slots, one ``(parts, pages, page_bytes)`` tensor per pool."""

    def __init__(
        self,
        pools: Sequence[Any],
        sources: dict[str, list[torch.Tensor]],
        pages: int,
        *,
        memory: HostMemory,
        device: DeviceBinding,
    ) -> None:
        self.pages = pages
        self._pools = list(pools)
        self._sources = sources  # pool name -> per-part device rows (page, bytes)
        self._memory = memory
        self._device = device  # bound by the stager thread before any CUDA call
        self.buffers = {
            p.name: memory.alloc_like((len(p.spans), pages, p.page_bytes))
            for p in self._pools
        }
        # Device gather buffer (SCRATCH_BYTES), allocated by the first copy on
        # the stager's stream.
        self._scratch: torch.Tensor | None = None
        self._free: collections.deque[int] = collections.deque(range(pages))
        self._jobs: queue.SimpleQueue[StageJob | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name="kvcr-stager", daemon=True
        )
        self._thread.start()

    def part_rows(self) -> dict[str, list[torch.Tensor]]:
        """Per pool, each part's ``(slots, page bytes)`` rows (what deposits read)."""
        return {name: list(buf.unbind(0)) for name, buf in self.buffers.items()}

    @staticmethod
    def block_source(pool: Any, slot: int) -> tuple[str, int]:
        """A deposit's source for one page staged in ``slot`` of ``pool``."""
        return (pool.block_label, slot)

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

    def close(self, timeout_s: float) -> bool:
        """Stop the stager; False when it is still running at the deadline (its
        slots may still be written: the owner keeps the buffers locked)."""
        self._jobs.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("KVCR stager did not stop within %.1f s", timeout_s)
            return False
        return True

    def _run(self) -> None:
        stream, dead = self._device.start_side_thread(
            "stager cannot use its device; offloads fail"
        )
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if dead is not None:
                job.fail(dead)
                continue
            try:
                if job.copies:
                    self._copy(job, stream)
            except BaseException as exc:
                logger.exception("KVCR offload staging copy failed")
                try:
                    drain(stream)  # nothing may still write the slots it frees
                except BaseException:
                    logger.exception("KVCR stager stream could not be drained")
                job.fail(exc)
                continue
            try:
                job.submit()
            except Exception:
                logger.exception("KVCR offload could not be submitted")

    SCRATCH_BYTES = 32 << 20

    def _copy(self, job: StageJob, stream: Any) -> None:
        """Device pages -> staging slots; returns once every byte has landed."""
        with self._device.on(stream):
            wait_fences(stream, job.events)
            for name, device_pages, slot_list in job.copies:
                if not slot_list:
                    continue
                staged = self.buffers[name]
                for part, rows in enumerate(self._sources[name]):
                    self._copy_part(rows, device_pages, staged[part], slot_list)
        drain(stream)

    def _copy_part(
        self,
        rows: torch.Tensor,
        pages: torch.Tensor,
        staged: torch.Tensor,
        slots: Sequence[int],
    ) -> None:
        """Gather ``rows[pages]`` on the device in scratch-sized chunks and copy
        each run of consecutive slots with one asynchronous copy."""
        row_bytes = rows.shape[1]
        per_chunk = max(1, self.SCRATCH_BYTES // row_bytes)
        if self._scratch is None or self._scratch.numel() < per_chunk * row_bytes:
            self._scratch = torch.empty(
                per_chunk * row_bytes, dtype=torch.uint8, device=rows.device
            )
        for a in range(0, len(slots), per_chunk):
            b = min(len(slots), a + per_chunk)
            picked = self._scratch[: (b - a) * row_bytes].view(b - a, row_bytes)
            torch.index_select(rows, 0, pages[a:b], out=picked)
            for lo, hi in _runs(slots, a, b):
                start = slots[lo]
                staged[start : start + hi - lo].copy_(
                    picked[lo - a : hi - a], non_blocking=True
                )


def _runs(slots: Sequence[int], a: int, b: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` index ranges of ``slots[a:b]`` whose slots are consecutive."""
    out: list[tuple[int, int]] = []
    lo = a
    for i in range(a + 1, b + 1):
        if i == b or slots[i] != slots[i - 1] + 1:
            out.append((lo, i))
            lo = i
    return out
