"""The one copy of an offload: framework page rows straight into KVCR DRAM slots.

KVCR allocates a deposit's slots and marks them FILLING; its copy op (patched in
``kvcr_patches.local_copy``) hands the (source row, slot) pairs to this copier and
completes, READY or failed, only when a job says every byte landed or that none
will be written any more. A copier thread runs the jobs in order. On CPU each
part's rows move with one ``index_select`` per arithmetic run of slots, written
in place into the KVCR DRAM slots (16- or 8-byte elements): one pass over the
bytes. On CUDA each run of consecutive slots is gathered on the device into a
bounded scratch buffer and moved with one asynchronous device-to-host copy into
the page-locked slots, on the copier's own stream, which is drained before the
job reports. A deposit is only submitted after the offload's fences completed,
so the rows are final when read. A slot whose pool no longer sits where kvcr
thinks (the DRAM was replaced after a failed close) fails the job: it is never
written.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sglang.srt.mem_cache.storage.kvcr.datapath.restore_copy import wide_rows
from sglang.srt.mem_cache.storage.kvcr.device.device_streams import (
    DeviceBinding,
    drain,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches.local_copy import SlotRef

logger = logging.getLogger(__name__)


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclasses.dataclass(slots=True, eq=False)
class CopyJob:
    """One deposit's pairs; ``poll`` is None until no byte of it can still be
    written, then whether all of them landed."""

    sources: list[tuple[str, int]]
    slots: list[SlotRef]
    deadline: float
    state: JobState = JobState.QUEUED
    landed: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def poll(self) -> bool | None:
        return self.landed if self.state is JobState.DONE else None

    def cancel(self) -> None:
        with self.lock:
            if self.state is JobState.QUEUED:
                self.state = JobState.DONE  # never started: nothing writes its slots

    def claim(self) -> bool:
        """Move to RUNNING unless cancelled or past its deadline."""
        with self.lock:
            if self.state is not JobState.QUEUED:
                return False
            if time.monotonic() >= self.deadline:
                self.state = JobState.DONE
                return False
            self.state = JobState.RUNNING
            return True

    def finish(self, landed: bool) -> None:
        with self.lock:
            self.landed = landed
            self.state = JobState.DONE


class CopyRefused(RuntimeError):
    """A pair this copier cannot write (unknown row, size mismatch, DRAM moved)."""


def plan_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``[a, b)`` index ranges of ``slots`` whose values advance by one positive
    stride, with that stride (1 for a single slot)."""
    runs: list[tuple[int, int, int]] = []
    n, a = len(slots), 0
    while a < n:
        b, stride = a + 1, 0
        while b < n:
            step = slots[b] - slots[b - 1]
            if step <= 0 or (stride and step != stride):
                break
            stride = step
            b += 1
        runs.append((a, b, stride or 1))
        a = b
    return runs


class DramCopier:
    """Copies deposits' rows into KVCR DRAM on its own thread (see module doc).

    ``sources``: framework label -> its ``(elements, row bytes)`` row view (the
    pool's page rows, or the staging area's); ``storage``: the current KVCR DRAM
    per pool (read at copy time)."""

    SCRATCH_BYTES = 32 << 20

    def __init__(
        self,
        sources: dict[str, torch.Tensor],
        storage: Callable[[], dict[str, torch.Tensor]],
        device: DeviceBinding,
    ) -> None:
        self._sources = sources
        self._storage = storage
        self._device = device
        self._jobs: queue.SimpleQueue[CopyJob | None] = queue.SimpleQueue()
        self._scratch: torch.Tensor | None = None
        self.copied_bytes = 0
        # A failed copy whose stream would not drain: the device is wedged, that
        # job stays RUNNING (its slots may still be written, never freed) and
        # every later job fails at once. The linker goes down for good.
        self.wedged = False
        self._thread = threading.Thread(
            target=self._run, name="kvcr-dram-copy", daemon=True
        )
        self._thread.start()

    def start(
        self, sources: list[tuple[str, int]], slots: list[SlotRef], deadline: float
    ) -> CopyJob:
        job = CopyJob(sources, slots, deadline)
        self._jobs.put(job)
        return job

    def close(self, timeout_s: float) -> bool:
        """Stop the thread; False while a copy may still be running."""
        self._jobs.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("KVCR DRAM copier did not stop within %.1f s", timeout_s)
            return False
        return not self.wedged

    def _run(self) -> None:
        stream, dead = self._device.start_side_thread(
            "DRAM copier cannot use its device; offloads fail"
        )
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if not job.claim():
                continue  # cancelled or late: failed, its slots never written
            if dead is not None or self.wedged:
                job.finish(False)
                continue
            try:
                self._copy(job, stream)
                job.finish(True)
            except BaseException:
                logger.exception("KVCR offload copy into DRAM failed")
                try:
                    drain(stream)  # nothing may still write the slots it frees
                except BaseException:
                    logger.exception(
                        "KVCR DRAM copier stream could not be drained: the device "
                        "is wedged; offloads fail from now on"
                    )
                    self.wedged = True  # the job stays RUNNING: slots never freed
                    continue
                job.finish(False)

    def _copy(self, job: CopyJob, stream: Any) -> None:
        """Every pair of ``job``; returns once all bytes have landed."""
        groups = self._groups(job)
        if stream is None:
            for rows, store, pages, slots in groups:
                _copy_rows(rows, store, pages, slots)
        else:
            with self._device.on(stream):
                for rows, store, pages, slots in groups:
                    self._copy_rows_device(rows, store, pages, slots)
            drain(stream)
        self.copied_bytes += sum(len(g[2]) * g[0].shape[1] for g in groups)

    def _groups(
        self, job: CopyJob
    ) -> list[tuple[torch.Tensor, torch.Tensor, list[int], list[int]]]:
        """Per (source label, pool): its row view, the pool's slot rows, and the
        (row, slot) pairs in slot order; refuses any pair it cannot write."""
        storage = self._storage()
        by_key: dict[tuple[str, str], tuple[list[int], list[int]]] = {}
        views: dict[str, torch.Tensor] = {}
        for (label, index), ref in zip(job.sources, job.slots, strict=True):
            rows = self._sources.get(label)
            store = storage.get(ref.pool)
            if store is None or store.data_ptr() != ref.address:
                raise CopyRefused(f"KVCR DRAM of pool {ref.pool!r} was replaced")
            if rows is None or not 0 <= index < rows.shape[0]:
                raise CopyRefused(f"no framework row {label!r}[{index}]")
            if rows.shape[1] != ref.slot_bytes:
                raise CopyRefused(f"{label!r} rows are not {ref.slot_bytes} bytes")
            if ref.pool not in views:
                count = store.numel() * store.element_size() // ref.slot_bytes
                views[ref.pool] = store.view(torch.uint8)[
                    : count * ref.slot_bytes
                ].view(count, ref.slot_bytes)
            if not 0 <= ref.slot < views[ref.pool].shape[0]:
                raise CopyRefused(f"slot {ref.slot} is outside pool {ref.pool!r}")
            pages, slots = by_key.setdefault((label, ref.pool), ([], []))
            pages.append(index)
            slots.append(ref.slot)
        out = []
        for (label, pool), (pages, slots) in by_key.items():
            order = sorted(range(len(slots)), key=slots.__getitem__)
            out.append(
                (
                    self._sources[label],
                    views[pool],
                    [pages[i] for i in order],
                    [slots[i] for i in order],
                )
            )
        return out

    def _copy_rows_device(
        self,
        rows: torch.Tensor,
        store: torch.Tensor,
        pages: list[int],
        slots: list[int],
    ) -> None:
        """Device rows -> page-locked slots: per chunk of consecutive slots, gather
        on the device, then one asynchronous copy (queued on the current stream;
        the caller drains it)."""
        row_bytes = rows.shape[1]
        per_chunk = max(1, self.SCRATCH_BYTES // row_bytes)
        if self._scratch is None or self._scratch.numel() < per_chunk * row_bytes:
            # Only between jobs (each drains its stream): no copy reads the old one.
            self._scratch = torch.empty(
                per_chunk * row_bytes, dtype=torch.uint8, device=rows.device
            )
        index = torch.tensor(pages, dtype=torch.long).to(rows.device)
        for a, b, stride in plan_runs(slots):
            if stride != 1:
                for i in range(a, b):
                    self._copy_chunk(rows, store, index, i, i + 1, slots[i])
                continue
            for lo in range(a, b, per_chunk):
                hi = min(b, lo + per_chunk)
                self._copy_chunk(rows, store, index, lo, hi, slots[a] + lo - a)

    def _copy_chunk(
        self,
        rows: torch.Tensor,
        store: torch.Tensor,
        index: torch.Tensor,
        lo: int,
        hi: int,
        first_slot: int,
    ) -> None:
        assert self._scratch is not None
        row_bytes = rows.shape[1]
        picked = self._scratch[: (hi - lo) * row_bytes].view(hi - lo, row_bytes)
        torch.index_select(rows, 0, index[lo:hi], out=picked)
        store[first_slot : first_slot + hi - lo].copy_(picked, non_blocking=True)


def _copy_rows(
    rows: torch.Tensor, store: torch.Tensor, pages: list[int], slots: list[int]
) -> None:
    """Host rows -> slots: one ``index_select`` per arithmetic run of slots, its
    output a strided view of the slots themselves (no intermediate copy)."""
    src = wide_rows(rows)
    dst = wide_rows(store)
    if src.dtype != dst.dtype:  # different alignment: plain bytes on both sides
        src, dst = rows, store
    width = dst.shape[1]
    index = torch.tensor(pages, dtype=torch.long)
    for a, b, stride in plan_runs(slots):
        out = dst.as_strided(
            (b - a, width),
            (stride * dst.stride(0), 1),
            dst.storage_offset() + slots[a] * dst.stride(0),
        )
        torch.index_select(src, 0, index[a:b], out=out)
