"""The one copy of an offload: pool pages straight into KVCR DRAM slots.

A deposit (``kvcr_patches.page_fills``) reserves one KVCR slot per page through
kvcr's fill path and hands the (source page, slot) pairs to this copier; the fill
completes, READY or freed, only when a job says every byte landed or that none
will be written any more. A slot holds every span of its page in span order. A
copier thread runs the jobs in order. From host rows (a CPU pool, or a staged
offload's staging rows on any host) every span of a run of consecutive
slots moves with one ``index_select`` over the pool's spans viewed as rows of
one tensor (``span_rows``), written in place into the slots: one pass over the
bytes, one parallel region per run. From device pages each run of
consecutive slots is gathered on the device and moved with one asynchronous
device-to-host copy into the page-locked slots (``device_gather``), on the
copier's own stream; a job reports only once the event recorded after its copies
has completed, and the next job's copies are queued meanwhile (two jobs in
flight at most). A deposit is only submitted after the offload's fences
completed, so the rows are final when read. A slot whose pool no longer sits
where kvcr thinks (the DRAM was replaced after a failed close) fails the job:
it is never written.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from sglang.srt.mem_cache.storage.kvcr.datapath.copy_jobs import (
    CopyJob,
    CopyRefused,
    PoolCopy,
    SlotViews,
)
from sglang.srt.mem_cache.storage.kvcr.datapath.device_gather import DeviceGather
from sglang.srt.mem_cache.storage.kvcr.datapath.span_rows import span_rows
from sglang.srt.mem_cache.storage.kvcr.device.device_streams import (
    DRAIN_TIMEOUT_S,
    FIRST_PAUSE_S,
    DeviceBinding,
    drain,
    next_pause,
    wait_event,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches.page_fills import SlotRef

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class Issued:
    """A job whose copies are queued: the event after them (None on CPU, where
    they ran inline), and its pools' views and DRAM, held until it settles."""

    job: CopyJob
    done: Any
    groups: list[PoolCopy]
    nbytes: int
    stall_at: float  # monotonic: a copy not ended by then wedges the copier


_SETTLE = object()  # the copier's next step: settle its oldest copy in flight


class DramCopier:
    """Copies deposits' pages into KVCR DRAM on its own thread (module doc).

    ``sources``: KVCR pool -> each span's ``(pages, page bytes)`` row view, in span
    order (the pool's page rows, or the staging area's); ``storage``: the current
    KVCR DRAM per pool (read at copy time)."""

    # On a device the copy is DMA: a deposit's first 8 pages start moving while
    # kvcr allocates the rest, 16 at a time (page_fills). On CPU the copy needs
    # the cores kvcr's allocation runs on: one reservation (measured faster).
    DEVICE_CHUNKS = (8, 16)

    def __init__(
        self,
        sources: dict[str, list[torch.Tensor]],
        storage: Callable[[], dict[str, torch.Tensor]],
        device: DeviceBinding,
    ) -> None:
        self._sources = sources
        # Per pool: (pages every span has, bytes of one page over all spans),
        # computed once (a pool of many layers has many spans).
        self._extent = {
            name: (min(p.shape[0] for p in parts), sum(p.shape[1] for p in parts))
            for name, parts in sources.items()
            if parts
        }
        self._storage = storage
        self._device = device
        self._jobs: queue.SimpleQueue[CopyJob | None] = queue.SimpleQueue()
        self.gather = DeviceGather()  # device pools' scratch (first copy)
        self._views: dict[str, SlotViews] = {}  # CPU pools, for their current DRAM
        on_device = any(p.is_cuda for parts in sources.values() for p in parts)
        self.chunks = self.DEVICE_CHUNKS if on_device else None  # staging: host
        self.copied_bytes = 0
        self.recent: collections.deque[CopyJob] = collections.deque(maxlen=64)
        # A failed copy whose stream would not drain: the device is wedged, that
        # job stays RUNNING (its slots may still be written, never freed) and
        # every later job fails at once. The linker goes down for good.
        self.wedged = False
        self._thread = threading.Thread(
            target=self._run, name="kvcr-dram-copy", daemon=True
        )
        self._thread.start()

    def start(
        self,
        pairs: list[tuple[int, SlotRef]],
        deadline: float,
        on_done: Callable[[], object] | None = None,
    ) -> CopyJob:
        job = CopyJob(pairs, deadline, on_done)
        self.recent.append(job)
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

    # Jobs whose copies are queued on the device at once: the next job's gathers
    # and copy are queued while the previous one's copy still runs, so the copy
    # engine does not idle while this thread launches (CPU: copies are inline).
    IN_FLIGHT = 2

    def _run(self) -> None:
        stream, dead = self._device.start_side_thread(
            "DRAM copier cannot use its device; offloads fail"
        )
        in_flight: collections.deque[Issued] = collections.deque()
        try:
            self._loop(stream, dead, in_flight)
        except BaseException:
            # A bug or a device error outside a job's own handling: whatever is
            # in flight may still be written, so nothing is freed; offloads fail.
            logger.exception("KVCR DRAM copier stopped; offloads fail from now on")
            self.wedged = True

    def _loop(
        self,
        stream: Any,
        dead: BaseException | None,
        in_flight: collections.deque[Issued],
    ) -> None:
        while True:
            job = self._next_job(in_flight)
            if job is _SETTLE:  # the oldest copy in flight ended (or stalled)
                self._settle(in_flight.popleft())
                continue
            if job is None:
                while in_flight:
                    self._settle(in_flight.popleft())
                return
            assert isinstance(job, CopyJob)
            if not job.claim():
                continue  # cancelled or late: failed, its slots never written
            if dead is not None or self.wedged:
                job.finish(False)
                continue
            try:
                in_flight.append(self._issue(job, stream))
            except BaseException:
                logger.exception("KVCR offload copy into DRAM failed")
                self._fail(job, stream, in_flight)
                continue
            # A CPU job has landed already (inline): it reports at once.
            while in_flight and (
                len(in_flight) >= self.IN_FLIGHT or in_flight[0].done is None
            ):
                self._settle(in_flight.popleft())

    def _next_job(self, in_flight: collections.deque[Issued]) -> object:
        """The next queued job (None: stop); while a copy is in flight, _SETTLE
        as soon as the oldest one has ended or passed its stall deadline, so a
        job queued meanwhile is issued at once and an ended one reports at once
        (polled as ``drain`` polls: ``next_pause``)."""
        if not in_flight:
            return self._jobs.get()
        head, pause, start = in_flight[0], FIRST_PAUSE_S, time.monotonic()
        while True:
            try:
                return self._jobs.get(timeout=pause)
            except queue.Empty:
                pass
            now = time.monotonic()
            try:
                ended = head.done is None or head.done.query()
            except BaseException:  # a device error: _settle's wait raises it
                return _SETTLE
            if ended or now >= head.stall_at:
                return _SETTLE
            pause = next_pause(pause, now - start)

    def _issue(self, job: CopyJob, stream: Any) -> Issued:
        """Queue every pair of ``job`` (CPU: copy them); the copies' end event."""
        groups = self._groups(job)
        with self._device.on(stream):
            for group in groups:
                if group.views.rows is not None:  # host rows: a CPU pool, staging
                    _copy_pages(group)
                else:
                    self._copy_pages_device(group)
            done = self._device.mark(stream)
        job.issued = time.monotonic()
        nbytes = sum(len(g.pages) * g.slots_view.shape[1] for g in groups)
        return Issued(job, done, groups, nbytes, job.issued + DRAIN_TIMEOUT_S)

    def _settle(self, issued: Issued) -> None:
        """Wait (with a deadline) until ``issued``'s bytes have landed; finish it.
        A copy that never completes wedges the copier: the job stays RUNNING."""
        if self.wedged:
            return  # its slots may still be written: never freed
        if issued.done is not None:
            try:
                wait_event(issued.done, max(0.0, issued.stall_at - time.monotonic()))
            except BaseException:
                logger.exception(
                    "KVCR DRAM copy did not complete: the device is wedged; "
                    "offloads fail from now on"
                )
                self.wedged = True
                return
        self.copied_bytes += issued.nbytes
        issued.job.finish(True)

    def _fail(
        self, job: CopyJob, stream: Any, in_flight: collections.deque[Issued]
    ) -> None:
        """``job`` failed while queuing: drain the stream (nothing may still write
        the slots it frees), settle the jobs queued before it, fail it."""
        try:
            drain(stream)
        except BaseException:
            logger.exception(
                "KVCR DRAM copier stream could not be drained: the device "
                "is wedged; offloads fail from now on"
            )
            self.wedged = True  # every job in flight stays RUNNING
            return
        while in_flight:
            self._settle(in_flight.popleft())
        job.finish(False)

    def _groups(self, job: CopyJob) -> list[PoolCopy]:
        """Per pool: its spans' rows, its slot rows and the (page, slot) pairs in
        slot order; refuses any pair it cannot write."""
        storage = self._storage()
        by_pool: dict[str, list[tuple[int, int]]] = {}
        views: dict[str, SlotViews] = {}
        stores: dict[str, torch.Tensor] = {}  # the DRAM checked, held for the job
        for page, ref in job.pairs:
            seen = views.get(ref.pool)
            if seen is None or seen.key[:2] != (ref.address, ref.slot_bytes):
                # Checked once per pool and place: another place is refused.
                store = storage.get(ref.pool)
                if store is None:
                    raise CopyRefused(f"KVCR pool {ref.pool!r} has no DRAM")
                views[ref.pool] = self._slot_views(ref, store)
                stores[ref.pool] = store
            if not 0 <= page < self._extent[ref.pool][0]:
                raise CopyRefused(f"no page {page} in pool {ref.pool!r}")
            if not 0 <= ref.slot < views[ref.pool].slots.shape[0]:
                raise CopyRefused(f"slot {ref.slot} is outside pool {ref.pool!r}")
            by_pool.setdefault(ref.pool, []).append((ref.slot, page))
        out = []
        for pool, pairs in by_pool.items():
            pairs.sort()
            if any(a[0] == b[0] for a, b in itertools.pairwise(pairs)):
                raise CopyRefused(f"a slot of pool {pool!r} is named twice")
            out.append(
                PoolCopy(
                    self._sources[pool],
                    views[pool],
                    [page for _, page in pairs],
                    [slot for slot, _ in pairs],
                    stores[pool],
                )
            )
        return out

    def _slot_views(self, ref: SlotRef, store: torch.Tensor) -> SlotViews:
        """``ref``'s pool's slot views over its current DRAM ``store``.

        A CPU pool's views are built once per DRAM and own nothing (a replaced
        DRAM is never kept alive by them): they are used only after ``store``,
        held by the caller for the job, was seen at the same address and size."""
        if store.data_ptr() != ref.address:
            raise CopyRefused(f"KVCR DRAM of pool {ref.pool!r} was replaced")
        extent = self._extent.get(ref.pool)
        if extent is None or extent[1] != ref.slot_bytes:
            raise CopyRefused(f"{ref.pool!r} pages are not {ref.slot_bytes} bytes")
        count = store.numel() * store.element_size() // ref.slot_bytes
        key = (ref.address, ref.slot_bytes, count)
        parts = self._sources[ref.pool]
        if parts[0].device.type != "cpu":
            slots = store.view(torch.uint8)[: count * ref.slot_bytes]
            return SlotViews(key, slots.view(count, ref.slot_bytes))
        if store.device.type != "cpu" or not store.is_contiguous():
            raise CopyRefused(
                f"KVCR DRAM of pool {ref.pool!r} is not dense host memory"
            )
        cached = self._views.get(ref.pool)
        if cached is not None and cached.key == key:
            return cached
        rows = span_rows(parts)
        if count < 1 or rows.spans * rows.width != ref.slot_bytes:
            raise CopyRefused("pool pages and KVCR slots do not match")
        raw = (ctypes.c_uint8 * (count * ref.slot_bytes)).from_address(ref.address)
        slots = torch.frombuffer(raw, dtype=torch.uint8).view(count, ref.slot_bytes)
        elem = rows.elem(slots)
        views = SlotViews(
            key, slots, rows, elem, rows.rows(elem), rows.slot_rows(slots, elem)
        )
        self._views[ref.pool] = views
        return views

    def _copy_pages_device(self, group: PoolCopy) -> None:
        """Device pages -> page-locked slots (``device_gather``), queued on the
        current stream."""
        self.gather.copy(group, self.chunks[-1] if self.chunks else None)


def _copy_pages(group: PoolCopy) -> None:
    """Host pages -> slots: per run of consecutive slots, one ``index_select`` of
    every span of its pages (``span_rows``) into the slots' rows themselves, no
    intermediate copy. Scattered slots (a churned DRAM frees them in eviction
    order) cost one op per slot, each still every span of a page. The row
    numbers come from numpy and the views are the pool's cached ones, so the
    only torch calls are one slice pair and the copy per run."""
    v = group.views
    if v.rows is None or v.src is None or v.dst is None:
        raise CopyRefused("pool pages and KVCR slots do not match")
    spans, slots = v.rows.spans, group.slots
    index = torch.from_numpy(v.rows.index_array(group.pages, v.elem).reshape(-1))
    a, n = 0, len(slots)
    while a < n:
        b = a + 1
        while b < n and slots[b] == slots[b - 1] + 1:
            b += 1
        first = slots[a] * spans
        out = v.dst[first : first + (b - a) * spans]
        torch.index_select(v.src, 0, index[a * spans : b * spans], out=out)
        a = b
