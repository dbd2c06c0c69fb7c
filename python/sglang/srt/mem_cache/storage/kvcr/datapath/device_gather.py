"""Device pages into page-locked KVCR slots: a gather on the device, one copy out.

Each run of consecutive slots is assembled on the device in a scratch half laid
out as the slots are (every span of a page in span order): one ``index_select``
kernel per span writes its columns in place, on 8-byte words where every span
allows (``word_rows``). A half holds up to a copier job where slots allow (at
most ``DramCopier.DEVICE_CHUNKS[-1]`` pages and half of ``SCRATCH_BYTES``): with a
32 MiB scratch (4 of Qwen3-0.6B's 7 MiB pages) the per-span launches, not the DMA,
bounded an H200's offload at 0.27-0.30x a pinned copy. Then one asynchronous
device-to-host copy moves the run into the slots. The gathers run on a second
stream and the copies on the caller's current stream, alternating between the
two halves (``scratch_relay``), so one chunk's gathers run beside the previous
chunk's copy; the caller's stream is made to wait for the gathers, and the
caller waits for an event recorded on it after the copies.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sglang.srt.mem_cache.storage.kvcr.datapath.copy_jobs import PoolCopy, plan_runs
from sglang.srt.mem_cache.storage.kvcr.datapath.device_pages import word_rows
from sglang.srt.mem_cache.storage.kvcr.datapath.page_rows_kernel import (
    DEVICE_ERRORS,
    RowKernel,
    kernel_for,
)
from sglang.srt.mem_cache.storage.kvcr.datapath.scratch_relay import (
    ScratchRelay,
    current_stream,
    join,
    on,
)
from sglang.srt.mem_cache.storage.kvcr.device.device_streams import device_index

logger = logging.getLogger(__name__)


class DeviceGather:
    """A copier thread's device scratch and gather (module doc)."""

    SCRATCH_BYTES = 128 << 20
    TWO_STREAMS = True

    def __init__(self) -> None:
        self.scratch_bytes = self.SCRATCH_BYTES
        self._relay: ScratchRelay | None = None
        # Each span's columns written directly; False (a torch refusing a
        # strided ``out``): through a temporary per span.
        self.in_place = True
        self._kernels: dict[Any, RowKernel] = {}  # per pool's parts

    def copy(self, group: PoolCopy, max_pages: int | None) -> None:
        """Device pages -> page-locked slots: per chunk of consecutive slots, each
        span gathered into its place in a scratch half laid out as the slots (on
        the second stream), then one asynchronous copy on the current stream (the
        caller waits for an event recorded there after them)."""
        slot_bytes = group.slots_view.shape[1]
        device = group.parts[0].device
        relay = self._relay_for(device, slot_bytes, max_pages)
        per_chunk = max(1, relay.half_bytes // slot_bytes)
        if max_pages:
            per_chunk = min(per_chunk, max_pages)
        main = current_stream(device)
        side = relay.side()
        words = word_rows(*group.parts)
        kernel = kernel_for(self._kernels, words) if words else None
        if kernel is not None and len(words) * kernel.width * 8 != slot_bytes:
            kernel = None
        try:
            with on(side):  # made and read where the gathers run
                index = device_index(group.pages, device)
            slots = group.slots
            for a, b, stride in plan_runs(slots):
                if stride != 1:
                    for i in range(a, b):
                        self._chunk(group, index, i, i + 1, main, side, kernel)
                    continue
                for lo in range(a, b, per_chunk):
                    hi = min(b, lo + per_chunk)
                    self._chunk(group, index, lo, hi, main, side, kernel)
        finally:  # the caller's event, and a failed job's drain, cover the gathers
            join(main, side)

    def _relay_for(
        self, device: torch.device, slot_bytes: int, max_pages: int | None
    ) -> ScratchRelay:
        """The scratch, each half holding ``scratch_bytes / 2`` (at most a job's
        pages, at least one slot). Made on the copier's stream; a replacement's
        old block returns to the caching allocator on this stream, so only work
        queued after the copies reading it can reuse it, and the second stream is
        ordered after everything queued so far before it writes the new one."""
        half = max(slot_bytes, self.scratch_bytes // 2)
        if max_pages:  # no job is larger: allocate no more than one job needs
            half = min(half, max_pages * slot_bytes)
        half = max(slot_bytes, half // slot_bytes * slot_bytes)
        relay = self._relay
        if relay is None:
            relay = self._relay = ScratchRelay(device, 2 * half, self.TWO_STREAMS)
        elif relay.grow(half) is None:
            return relay
        side = relay.side()
        if side is not None:  # its memory may have readers queued on this stream
            side.wait_stream(current_stream(device))
        return relay

    def _chunk(
        self,
        group: PoolCopy,
        index: torch.Tensor,
        lo: int,
        hi: int,
        main: Any,
        side: Any,
        kernel: RowKernel | None,
    ) -> None:
        """Pairs ``[lo, hi)`` (consecutive slots) through a scratch half: one
        gather kernel per span on the second stream, written in place into the
        span's columns, on 8-byte words where every span allows (``word_rows``);
        then the half's copy into the slots on the caller's stream."""
        assert self._relay is not None
        slot_bytes = group.slots_view.shape[1]
        half, buf = self._relay.take((hi - lo) * slot_bytes, side)
        block = buf.view(hi - lo, slot_bytes)
        picked, *parts = word_rows(block, *group.parts)
        with on(side):
            if (
                kernel is None
                or picked.dtype != torch.int64
                or not kernel.try_launch(
                    index,
                    (lo, hi),
                    picked,
                    range(kernel.parts),
                    picked.shape[1],
                    to_pool=False,
                )
            ):
                pages = index[lo:hi]
                offset = 0
                for rows in parts:
                    width = rows.shape[1]
                    self._gather(rows, pages, picked[:, offset : offset + width])
                    offset += width
        first = group.slots[lo]
        with self._relay.reading(half, side, main):
            group.slots_view[first : first + hi - lo].copy_(block, non_blocking=True)

    def _gather(
        self, rows: torch.Tensor, pages: torch.Tensor, target: torch.Tensor
    ) -> None:
        """``target[:] = rows[pages]``, in place where torch allows."""
        if self.in_place:
            try:
                torch.index_select(rows, 0, pages, out=target)
                return
            except DEVICE_ERRORS:
                raise  # the device failed: the job fails, the gather stays
            except RuntimeError:  # a torch that refuses a strided ``out``
                logger.warning(
                    "KVCR offload: index_select into scratch columns refused; "
                    "gathering through a temporary from now on",
                    exc_info=True,
                )
                self.in_place = False
        target.copy_(rows.index_select(0, pages))
