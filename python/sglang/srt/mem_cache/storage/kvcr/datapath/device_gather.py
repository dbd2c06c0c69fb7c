"""Device pages into page-locked KVCR slots: a gather on the device, one copy out.

Each run of consecutive slots is assembled on the device in a scratch buffer laid
out as the slots are (every span of a page in span order): one ``index_select``
kernel per span writes its columns in place, on 8-byte words where every span
allows (``word_rows``). The scratch holds a whole copier job where slots allow
(at most ``DramCopier.DEVICE_CHUNKS[-1]`` pages and ``SCRATCH_BYTES``): with a
32 MiB scratch (4 of Qwen3-0.6B's 7 MiB pages) the per-span launches, not the DMA,
bounded an H200's offload at 0.27-0.30x a pinned copy. Then one asynchronous
device-to-host copy moves the run into the slots. Everything is queued on the
caller's current stream, which orders the scratch's reuse; the caller waits for
an event recorded after it.
"""

from __future__ import annotations

import logging

import torch

from sglang.srt.mem_cache.storage.kvcr.datapath.copy_jobs import PoolCopy, plan_runs
from sglang.srt.mem_cache.storage.kvcr.datapath.device_pages import word_rows
from sglang.srt.mem_cache.storage.kvcr.device.device_streams import device_index

logger = logging.getLogger(__name__)

# Errors of the device itself (RuntimeError subclasses): never a sign that torch
# refuses the in-place gather.
_DEVICE_ERRORS: tuple[type[BaseException], ...] = tuple(
    t
    for t in (getattr(torch, "AcceleratorError", None), torch.OutOfMemoryError)
    if isinstance(t, type)
)


class DeviceGather:
    """A copier thread's device scratch and gather (module doc)."""

    SCRATCH_BYTES = 128 << 20

    def __init__(self) -> None:
        self.scratch_bytes = self.SCRATCH_BYTES
        self._scratch: torch.Tensor | None = None
        # Each span's columns written directly; False (a torch refusing a
        # strided ``out``): through a temporary per span.
        self.in_place = True

    def copy(self, group: PoolCopy, max_pages: int | None) -> None:
        """Device pages -> page-locked slots: per chunk of consecutive slots, each
        span gathered into its place in a scratch laid out as the slots, then one
        asynchronous copy (queued on the current stream; the caller waits for an
        event recorded after them)."""
        slot_bytes = group.slots_view.shape[1]
        per_chunk = max(1, self.scratch_bytes // slot_bytes)
        if max_pages:  # no job is larger: allocate no more than one job needs
            per_chunk = min(per_chunk, max_pages)
        device = group.parts[0].device
        if self._scratch is None or self._scratch.numel() < per_chunk * slot_bytes:
            # Also within a job (a pool of larger slots): the old block returns to
            # the caching allocator on this stream, so only work queued after the
            # copies reading it can reuse it.
            self._scratch = torch.empty(
                per_chunk * slot_bytes, dtype=torch.uint8, device=device
            )
        index = device_index(group.pages, device)
        slots = group.slots
        for a, b, stride in plan_runs(slots):
            if stride != 1:
                for i in range(a, b):
                    self._chunk(group, index, i, i + 1)
                continue
            for lo in range(a, b, per_chunk):
                self._chunk(group, index, lo, min(b, lo + per_chunk))

    def _chunk(self, group: PoolCopy, index: torch.Tensor, lo: int, hi: int) -> None:
        """Pairs ``[lo, hi)`` (consecutive slots) through the scratch: one gather
        kernel per span, written in place into the span's columns, on 8-byte
        words where every span allows (``word_rows``)."""
        assert self._scratch is not None
        slot_bytes = group.slots_view.shape[1]
        block = self._scratch[: (hi - lo) * slot_bytes].view(hi - lo, slot_bytes)
        picked, *parts = word_rows(block, *group.parts)
        pages = index[lo:hi]
        offset = 0
        for rows in parts:
            width = rows.shape[1]
            target = picked[:, offset : offset + width]
            if self.in_place:
                try:
                    torch.index_select(rows, 0, pages, out=target)
                except _DEVICE_ERRORS:
                    raise  # the device failed: the job fails, the gather stays
                except RuntimeError:  # a torch that refuses a strided ``out``
                    logger.warning(
                        "KVCR offload: index_select into scratch columns refused; "
                        "gathering through a temporary from now on",
                        exc_info=True,
                    )
                    self.in_place = False
            if not self.in_place:
                target.copy_(rows.index_select(0, pages))
            offset += width
        first = group.slots[lo]
        group.slots_view[first : first + hi - lo].copy_(block, non_blocking=True)
