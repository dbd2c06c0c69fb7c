"""The GPU restore copy: claimed page-locked KVCR DRAM slots into device page rows.

Each run of claimed slots (``restore_copy.plan_segments``) moves to the device as
contiguous host-to-device copies into alternate halves of a device scratch, and
each half is scattered into the pool's page rows on a second stream
(``scratch_relay``), every part in one launch (``page_rows_kernel``) or one
``index_copy_`` per part; pages whose parts lie far apart are gathered on the host
first. ``datapath/restore.py``'s loader runs it on its own stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from sglang.srt.mem_cache.storage.kvcr.datapath.page_rows_kernel import (
    RowKernel,
    kernel_for,
    warm,
)
from sglang.srt.mem_cache.storage.kvcr.datapath.restore_copy import (
    Segment,
    plan_segments,
)
from sglang.srt.mem_cache.storage.kvcr.datapath.scratch_relay import (
    ScratchRelay,
    current_stream,
    join,
)
from sglang.srt.mem_cache.storage.kvcr.device.device_streams import (
    device_index,
    wait_event,
)
from sglang.srt.mem_cache.storage.kvcr.device.host_memory import HostMemory


@dataclasses.dataclass(frozen=True, slots=True)
class _PoolCopy:
    """One ``copy_pool`` call: what its span and gather steps share."""

    dest_parts: Sequence[torch.Tensor]
    dest: torch.Tensor
    store: torch.Tensor
    src_slots: Sequence[tuple[int, ...]]
    cap_rows: int  # rows of ``store`` one scratch half holds
    main: Any  # the caller's stream (None on CPU): the host-to-device copies
    side: Any  # the scatters' stream (None: the caller's)
    kernel: RowKernel | None

    @property
    def nparts(self) -> int:
        return len(self.dest_parts)

    @property
    def row_bytes(self) -> int:
        return self.store.shape[1] * self.store.element_size()


class SpanRestore:
    """The GPU restore copy. KVCR DRAM is page-locked, so each run of claimed slots
    moves to the device as one contiguous span (one asynchronous host-to-device
    copy per scratch-sized chunk, at DMA speed, no host-side gather) and is
    scattered into the destination page rows by device kernels, one per part.

    Rows of a run are ``first[part] + page * stride``; KVCR gives an object's parts
    adjacent slots, so a run's span is dense (``stride`` = parts). A run whose span
    would be more than twice its bytes goes page by page; pages whose own parts lie
    far apart (churned DRAM) are gathered on the host into a locked scratch buffer
    (torch's intra-op threads) and moved with one copy per chunk. The copies are
    queued on the caller's current stream into alternate halves of the device
    scratch, and each half's scatter on a second stream (``scratch_relay``), so
    one chunk's copy runs beside the previous chunk's scatter; the caller's
    stream is made to wait for the scatters before ``copy_pool`` returns. The
    host scratch is rewritten only after the copy reading it has finished. The
    caller drains its stream before the claims or the destination slots are
    given back, and then calls ``drained``. With a CPU device the same steps
    run synchronously.

    The device scratch is sized at startup for the largest page (``scratch_for``);
    should a page part still outgrow it, the replacement is made on the caller's
    stream while copies queued there may still read the old block, so the old
    block stays referenced (``_retired``) until ``drained``: freed earlier, the
    caching allocator would hand it to the stream it was allocated on (the
    scheduler's) while the loader stream still reads it.
    """

    # Each chunk costs one scatter launch per part from Python (56 for
    # Qwen3-0.6B): with 32 MiB chunks those launches, not the DMA, bounded an
    # H200's restore at 0.50-0.60x a pinned copy; at 128 MiB the copy leads.
    # Since the second H200 run (0.64-0.77x) the scratch is two halves, one
    # copied into while the other is scattered on a second stream
    # (``scratch_relay``); ``TWO_STREAMS`` off: both on the loader's stream.
    SCRATCH_BYTES = 128 << 20
    TWO_STREAMS = True

    def __init__(
        self,
        device: torch.device,
        memory: HostMemory | None = None,
        scratch_bytes: int = SCRATCH_BYTES,
    ) -> None:
        self.device = device
        self.scratch_bytes = scratch_bytes
        self._memory = memory or HostMemory(pin=False)
        # Allocated up front so a GPU host fails at startup, not mid-restore.
        self._relay = ScratchRelay(device, scratch_bytes, self.TWO_STREAMS)
        warm(device)  # the one-launch kernel compiled now, never while serving
        # The scratch came from the current (scheduler) stream's pool: the first
        # copy's stream waits for what was queued there when it was made.
        self._born: Any = None
        if device.type == "cuda":
            self._born = torch.cuda.Event()
            self._born.record(torch.cuda.current_stream(device))
        self._retired: list[torch.Tensor] = []  # outgrown scratch, until drained
        self._host: torch.Tensor | None = None
        self._host_busy: Any = None  # event after the last copy out of _host
        self.gathered_pages = 0  # pages that went through the host gather
        self.span_copies = 0  # host-to-device span copies
        self.kernel_chunks = 0  # chunks scattered in one launch
        self._kernels: dict[Any, RowKernel] = {}  # per pool's parts

    @staticmethod
    def scratch_for(pools: Sequence[tuple[int, int]]) -> int:
        """Device scratch bytes that no copy outgrows, for pools given as (parts,
        part bytes of one page): each half holds a run's span, at most two
        pages' parts."""
        largest = max((2 * parts * nbytes for parts, nbytes in pools), default=0)
        return max(SpanRestore.SCRATCH_BYTES, 2 * largest)

    def _device_buffer(self, nbytes: int, writer: Any) -> tuple[int, torch.Tensor]:
        """The next scratch half for ``nbytes``, ``writer`` ordered after its last
        reader. A replacement is made on the loader's stream (the writer), and
        the old block is kept until drained: queued copies may still read it."""
        old = self._relay.grow(nbytes)
        if old is not None:
            self._retired.append(old)
        return self._relay.take(nbytes, writer)

    def _kernel(
        self,
        dest_parts: Sequence[torch.Tensor],
        dest: torch.Tensor,
        store: torch.Tensor,
    ) -> RowKernel | None:
        """The one-launch scatter for these parts (``page_rows_kernel``), or None:
        one ``index_copy_`` per part."""
        if dest.dtype != torch.int64 or store.dtype != torch.int64:
            return None
        kernel = kernel_for(self._kernels, dest_parts)
        if kernel is None or kernel.width != store.shape[1]:
            return None
        return kernel

    def _scatter_at_once(
        self,
        kernel: RowKernel | None,
        index: torch.Tensor,
        span: tuple[int, int],
        staged: torch.Tensor,
        rows: Sequence[int],
        stride: int,
    ) -> bool:
        """Pages ``index[span]``, part ``p`` of page ``i`` at staged row
        ``rows[p] + i * stride``, into the pool in one launch; False when there
        is no kernel or it was refused (the caller scatters part by part)."""
        if kernel is None or not kernel.try_launch(
            index.contiguous(), span, staged, rows, stride * kernel.width, True
        ):
            return False
        self.kernel_chunks += 1
        return True

    def drained(self) -> None:
        """The caller's stream has drained: outgrown scratch blocks may go."""
        self._retired.clear()

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        if self._host_busy is not None:  # the previous chunk's copy still reads it
            wait_event(self._host_busy)
            self._host_busy = None
        if self._host is None or self._host.numel() < nbytes:
            if self._host is not None:
                self._memory.release(self._host)
            self._host = self._memory.alloc(max(nbytes, self.scratch_bytes))
        return self._host[:nbytes]

    def close(self) -> None:
        """Unlock the host scratch (the caller has drained the stream)."""
        self.drained()
        if self._host is not None:
            self._memory.release(self._host)
            self._host = None

    def copy_pool(
        self,
        dest_parts: Sequence[torch.Tensor],
        dest: torch.Tensor,
        store: torch.Tensor,
        src_slots: Sequence[tuple[int, ...]],
    ) -> None:
        """``dest_parts[p][dest[i]] = store[src_slots[i][p]]`` for every page ``i``
        and part ``p``. ``dest_parts`` and ``store`` are 2-D row tensors of one
        element type; ``dest`` is a device index tensor."""
        nparts = len(dest_parts)
        row_bytes = store.shape[1] * store.element_size()
        cap_rows = max(nparts, self._relay.half_bytes // row_bytes)
        main = current_stream(self.device)
        side = self._relay.side()
        if self._born is not None and main is not None:
            main.wait_event(self._born)
            self._born = None
        if side is not None:
            side.wait_stream(main)  # the fences and the destination index
        job = _PoolCopy(
            dest_parts,
            dest,
            store,
            src_slots,
            cap_rows,
            main,
            side,
            self._kernel(dest_parts, dest, store),
        )
        try:
            scattered = self._copy_spans(job)
            if scattered:
                self._copy_gathered(job, scattered)
        finally:  # draining the loader's stream drains the scatters too
            join(main, side)

    def _copy_spans(self, job: _PoolCopy) -> list[int]:
        """Every dense run as span copies; the pages left for the host gather."""
        dest, store, nparts = job.dest, job.store, job.nparts
        main, side = job.main, job.side
        scattered: list[int] = []
        for seg in _dense_segments(plan_segments(job.src_slots), nparts):
            n = seg.stop - seg.start
            low, high = min(seg.first), max(seg.first)
            page_span = high - low + 1
            if page_span > 2 * nparts:  # this page's parts lie far apart
                scattered.extend(range(seg.start, seg.stop))
                continue
            per_chunk = max(
                1, (max(job.cap_rows, page_span) - page_span) // seg.stride + 1
            )
            for a in range(0, n, per_chunk):
                b = min(n, a + per_chunk)
                lo = low + a * seg.stride
                rows = page_span + (b - a - 1) * seg.stride
                half, buf = self._device_buffer(rows * job.row_bytes, main)
                staged = _rows(buf, store, rows)
                staged.copy_(store[lo : lo + rows], non_blocking=True)
                self.span_copies += 1
                with self._relay.reading(half, main, side):
                    if self._scatter_at_once(
                        job.kernel,
                        dest,
                        (seg.start + a, seg.start + b),
                        staged,
                        [f - low for f in seg.first],
                        seg.stride,
                    ):
                        continue
                    index = dest[seg.start + a : seg.start + b]
                    for part, target in enumerate(job.dest_parts):
                        view = staged.as_strided(
                            (b - a, staged.shape[1]),
                            (seg.stride * staged.stride(0), 1),
                            staged.storage_offset()
                            + (seg.first[part] - low) * staged.stride(0),
                        )
                        target.index_copy_(0, index, view)
        return scattered

    def _copy_gathered(self, job: _PoolCopy, pages: list[int]) -> None:
        """``pages`` gathered on the host first, chunk by chunk."""
        dest, store, nparts = job.dest, job.store, job.nparts
        main, side = job.main, job.side
        row_bytes = job.row_bytes
        per_chunk = max(1, job.cap_rows // nparts)
        for a in range(0, len(pages), per_chunk):
            chunk = pages[a : a + per_chunk]
            rows = len(chunk) * nparts
            host = _rows(self._host_buffer(rows * row_bytes), store, rows)
            slots = torch.tensor(
                [job.src_slots[i][p] for i in chunk for p in range(nparts)],
                dtype=torch.long,
            )
            torch.index_select(store, 0, slots, out=host)
            half, buf = self._device_buffer(rows * row_bytes, main)
            staged = _rows(buf, store, rows)
            staged.copy_(host, non_blocking=True)
            if main is not None:
                self._host_busy = torch.cuda.Event()
                self._host_busy.record(main)
            with self._relay.reading(half, main, side):
                index = dest.index_select(0, device_index(chunk, dest.device))
                if not self._scatter_at_once(
                    job.kernel, index, (0, len(chunk)), staged, range(nparts), nparts
                ):
                    by_page = staged.view(len(chunk), nparts, staged.shape[1])
                    for part, target in enumerate(job.dest_parts):
                        target.index_copy_(0, index, by_page[:, part])
            self.gathered_pages += len(chunk)


def _rows(buf: torch.Tensor, like: torch.Tensor, rows: int) -> torch.Tensor:
    """``buf`` (bytes) as ``rows`` rows of ``like``'s element type and width."""
    return buf.view(like.dtype).view(rows, like.shape[1])


def _dense_segments(segments: list[Segment], nparts: int) -> Iterator[Segment]:
    """Runs whose span is at most twice their bytes; a sparser run (pages far
    apart in DRAM) goes page by page, each page its own span."""
    for seg in segments:
        n = seg.stop - seg.start
        span = max(seg.first) - min(seg.first) + 1 + (n - 1) * seg.stride
        if n == 1 or span <= 2 * n * nparts:
            yield seg
            continue
        for i in range(n):
            first = tuple(f + i * seg.stride for f in seg.first)
            yield Segment(seg.start + i, seg.start + i + 1, first, 1)
