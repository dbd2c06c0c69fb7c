"""Restores: planning a request's load from its claims, and the copy that does it.

``plan_load`` turns a request's claimed pages and SGLang's load transfers into a
``LoadJob``: per KVCR pool, the destination device pages (a tensor where SGLang
computed it: no host sync) and the source DRAM slots, ``complete`` only when every
page is claimed in every pool it needs. ``Restorer`` queues jobs, starts them as a
layer-counter batch, copies claimed KVCR DRAM slots into the request's device
slots (on its loader thread, fenced after the forward stream, for GPU pools;
inline for CPU pools, which need the forward's cores: see ``row_team``), and
settles each batch into per-request verdicts and the claims to release. A failed
copy pauses new restores with a doubling backoff. It touches no KVCR API.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolTransfer

from sglang.srt.mem_cache.storage.kvcr.datapath.device_pages import covers, word_rows
from sglang.srt.mem_cache.storage.kvcr.datapath.restore_copy import CpuRestorePlan
from sglang.srt.mem_cache.storage.kvcr.datapath.row_team import RowTeam
from sglang.srt.mem_cache.storage.kvcr.datapath.span_restore import SpanRestore
from sglang.srt.mem_cache.storage.kvcr.datapath.span_rows import SpanRows, span_rows
from sglang.srt.mem_cache.storage.kvcr.device.device_streams import (
    DeviceBinding,
    drain,
    wait_fences,
)
from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import PageLayout
from sglang.srt.mem_cache.storage.kvcr.observability.linker_stats import (
    LinkerStats,
    Sample,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import ClaimId
from sglang.srt.mem_cache.storage.kvcr.owner.quarantine import KVCRDram
from sglang.srt.mem_cache.storage.kvcr.requests.preparation import Preparation

logger = logging.getLogger(__name__)

# A failed restore copy pauses restores (lookups miss) for this long, doubling
# per consecutive failure up to the cap; a batch that lands resets the backoff.
RESTORE_PAUSE_S = 5.0
RESTORE_PAUSE_MAX_S = 300.0


@dataclasses.dataclass(slots=True)
class LoadJob:
    rid: str
    # per KVCR pool: destination device pages (an index tensor on the pools'
    # device, empty unless complete), and slot element indices [page][part]
    dest_pages: dict[str, torch.Tensor]
    slots: dict[str, list[tuple[int, ...]]]
    claims: list[ClaimId]
    complete: bool  # every page claimed in every pool; else nothing is copied


def plan_load(
    rid: str,
    prep: Preparation | None,
    by_source: dict[str, PoolTransfer],
    layout: PageLayout,
    page_size: int,
) -> LoadJob:
    """The job restoring the KV transfer's pages (and each trailing pool's from
    its own transfer: SWA's window, Mamba's last-page state) from ``prep``'s
    claims; the claims it takes leave ``prep``."""
    kv = by_source["kv"]
    page_hashes = list(kv.keys or ())
    slots: dict[str, list[tuple[int, ...]]] = {}
    complete = prep is not None
    # Trailing pools restore their transfer's pages: the tail's last ones.
    trailing: dict[str, dict[str, int]] = {}
    for source, _ in layout.window_groups:
        t = by_source.get(source)
        order = {h: j for j, h in enumerate(t.keys or ())} if t is not None else {}
        if (
            t is None
            or t.device_indices is None
            or not order
            or list(order) != page_hashes[-len(order) :]
        ):
            complete = False  # the window must be the restored pages' trailing ones
        trailing[source] = order
    # Every page's claimed objects, taken out of ``prep`` in one pass ({} where
    # none landed); their claims are released after delivery.
    taken = (
        [{}] * len(page_hashes)
        if prep is None
        else prep.landed.take(prep.indices_of(page_hashes))
    )
    claims: list[ClaimId] = [c.claim for objs in taken for c in objs.values()]
    for pool in layout.pools:
        name = pool.name
        if pool.trailing:
            window = trailing[pool.indices_from]
            entries = [
                o.get(name)
                for h, o in zip(page_hashes, taken, strict=True)
                if h in window
            ]
        else:
            entries = [o.get(name) for o in taken]
        if any(entry is None for entry in entries):
            complete = False
        slots[name] = [entry.slots for entry in entries if entry is not None]
    # Destination pages stay where SGLang computed them (no host sync): each
    # pool takes its source transfer's pages in order, translated as its entry
    # does (trailing transfers' keys are the tail's last pages, checked above).
    dest: dict[str, torch.Tensor] = {}
    if complete:
        for pool in layout.pools:
            source = by_source[pool.indices_from]
            assert source.device_indices is not None
            dest[pool.name] = pool.device_pages(
                source.device_indices, len(slots[pool.name]), page_size
            )
    return LoadJob(rid, dest, slots, claims, complete)


def plan_transfers(
    rid: str,
    prep: Preparation | None,
    transfers: list[PoolTransfer],
    layout: PageLayout,
    page_size: int,
) -> LoadJob | None:
    """``plan_load`` over SGLang's load transfers; None when there is nothing to
    load or the slot indices do not cover the pages (then the wrapper
    recomputes; the answer depends on the transfers only, so every rank agrees)."""
    by_source = loadable_sources(rid, transfers, layout, page_size)
    if by_source is None:
        return None
    return plan_load(rid, prep, by_source, layout, page_size)


def loadable_sources(
    rid: str, transfers: list[PoolTransfer], layout: PageLayout, page_size: int
) -> dict[str, PoolTransfer] | None:
    """The load transfers by name, or None when ``plan_transfers`` refuses them
    (no KV pages, or slot indices that do not cover them)."""
    by_source = {str(t.name): t for t in transfers}
    kv = by_source.get("kv")
    if kv is None or not kv.keys:
        return None
    short = not covers(kv.device_indices, len(kv.keys), page_size)
    for pool in layout.window_pools:
        t = by_source.get(pool.indices_from)
        step = pool.index_page_size or page_size
        if t is not None and t.keys and not covers(t.device_indices, len(t.keys), step):
            short = True
    if short:
        logger.warning("KVCR load for %s: slot indices do not cover its pages", rid)
        return None
    return by_source


@dataclasses.dataclass(slots=True)
class BatchTimes:
    """The last restore batch's timeline (time.monotonic; 0.0 until reached),
    read by benchmarks: started by the scheduler, taken by the copying thread,
    its copies queued, every copy done (stream drained)."""

    started: float = 0.0
    taken: float = 0.0
    issued: float = 0.0
    drained: float = 0.0


class Restorer:
    """Queued and running restore batches of one rank (see the module docstring)."""

    def __init__(
        self,
        *,
        layout: PageLayout,
        device: DeviceBinding,
        dram: KVCRDram,
        dest_rows: dict[str, list[torch.Tensor]],
        counter: Any,
        stats: LinkerStats,
        span_restore: SpanRestore | None,
        name: str,
    ) -> None:
        self.layout = layout  # the geometry only: restores never build keys
        self._dram = dram  # its storage is replaced when a flush reallocates
        self.dest_rows = dest_rows
        self._span_rows: dict[str, SpanRows] = {}  # CPU pools, on first use
        self.counter = counter
        self.stats = stats
        self.span_restore = span_restore
        # CPU pools' copies: the scheduler thread and helpers as many as torch's
        # intra-op threads (read here, on the scheduler thread), if any.
        self.team = (
            None
            if device.is_cuda
            else RowTeam.for_caller(torch.get_num_threads(), f"{name}-rows")
        )
        self._device = device
        self._page_bytes = {p.name: p.page_bytes for p in layout.pools}
        self._queued: dict[str, LoadJob] = {}
        self._batches: dict[int, list[LoadJob]] = {}
        self._paused_until = 0.0
        self._failures = 0  # consecutive failed batches
        self.dead: BaseException | None = None  # why the loader cannot copy
        self.last_times = BatchTimes()
        self.jobs: queue.SimpleQueue[
            tuple[int, list[LoadJob], tuple[Any, ...]] | None
        ] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self.loader_main, name=name, daemon=True)
        try:
            self.thread.start()
        except BaseException:
            if self.team is not None:
                self.team.close(1.0)
            raise

    # ---- scheduler thread ----------------------------------------------------------

    @property
    def paused(self) -> bool:
        """Lookups miss: after a failed copy for a while, for good once the
        loader thread could not use its device."""
        return self.dead is not None or time.monotonic() < self._paused_until

    def queue(self, job: LoadJob, pages: int) -> list[ClaimId]:
        """Queue ``job`` (a load of ``pages`` pages); the claims of a job it
        replaces (to release)."""
        self.stats.loads += 1
        self.stats.load_pages += pages
        if not job.complete:
            self.stats.load_failures += 1
        old = self._queued.pop(job.rid, None)
        self._queued[job.rid] = job
        return [] if old is None else old.claims

    def cancel(self, rid: str) -> list[ClaimId] | None:
        """Drop ``rid``'s queued job; the claims it held (None if none queued)."""
        job = self._queued.pop(rid, None)
        return None if job is None else job.claims

    def start(self, forward_stream: Any) -> int:
        """Start every queued job as one layer-counter batch; -1 when none."""
        if not self._queued:
            return -1
        jobs = list(self._queued.values())
        self._queued.clear()
        index = self.counter.update_producer()
        self._batches[index] = jobs
        self.last_times = BatchTimes(started=time.monotonic())
        if self._device.is_cuda:
            # On the loader thread, after the destination indices (current
            # stream) and the launched batch (forward stream: pages freed by
            # overlap scheduling may still be written by it). The batch moves as
            # whole slot runs at DMA speed; its layers complete together.
            fences = self._device.record_fences(forward_stream)
            self.jobs.put((index, jobs, fences))
        else:
            # CPU pools: copy now on this thread (and its row team, or else its
            # intra-op threads). The forward needs the same cores, and a loader
            # thread's own OpenMP team would contend with the scheduler's.
            self.run_copy(index, jobs)
        return index

    def finish(self, index: int) -> tuple[dict[str, bool], list[ClaimId]]:
        """Wait for batch ``index``: whether each request's KV landed, and the
        claims to release. A job missing claims copied nothing and fails alone; a
        failed copy fails every job of the batch (any page may be partial)."""
        jobs = self._batches.pop(index, None)
        if jobs is None:
            return {}, []
        ok = bool(self.counter.finish(index))
        if ok:
            self.stats.restored_bytes += sum(
                len(pages) * self.layout.object_bytes[name]
                for job in jobs
                if job.complete
                for name, pages in job.slots.items()
            )
        claims = [c for job in jobs for c in job.claims]
        return {job.rid: ok and job.complete for job in jobs}, claims

    def quiesce(self, timeout_s: float) -> tuple[bool, list[ClaimId]]:
        """Finish every started batch within ``timeout_s``: (whether none is
        still copying at the deadline, the claims of what finished or was
        queued). A batch still copying keeps its DRAM and slots in use: the
        caller quarantines the DRAM."""
        claims = [c for job in self._queued.values() for c in job.claims]
        self._queued.clear()
        deadline = time.monotonic() + timeout_s
        quiet = True
        for index in list(self._batches):
            layers = self.counter.futures.get(index, [])
            left = max(0.0, deadline - time.monotonic())
            if concurrent.futures.wait(layers, timeout=left).not_done:
                logger.error("KVCR restore batch %d still copying at shutdown", index)
                self._batches.pop(index, None)
                quiet = False
                continue
            claims += self.finish(index)[1]
        return quiet, claims

    def is_quiescent(self) -> bool:
        return not self._batches

    @property
    def has_work(self) -> bool:
        """A job is queued or a batch started: something may still read the
        current DRAM's slots."""
        return bool(self._queued or self._batches)

    def close(self, timeout_s: float) -> bool:
        """Stop the loader thread (bounded); False if it is still running."""
        self.jobs.put(None)
        self.thread.join(timeout_s)
        # The team only copies on the scheduler thread (this one): idle now.
        team_stopped = self.team is None or self.team.close(timeout_s)
        if self.thread.is_alive():
            logger.error("KVCR restore loader did not stop within %.1f s", timeout_s)
            return False
        return team_stopped

    def close_span(self) -> None:
        """Unlock the span restorer's scratch: only once nothing can copy from it
        (the caller knows the whole linker stopped cleanly)."""
        if self.span_restore is not None:
            self.span_restore.close()

    # ---- loader thread (or inline on CPU) ------------------------------------------

    def loader_main(self) -> None:
        # This thread started on device 0; no stream: every batch fails.
        stream, self.dead = self._device.start_side_thread(
            "loader cannot use its device; restores are off"
        )
        while True:
            item = self.jobs.get()
            if item is None:
                return
            index, jobs, fences = item
            if self.dead is not None:
                self.counter.fail(index, self.dead)
                continue
            self.run_copy(index, jobs, fences, stream)

    def run_copy(
        self,
        index: int,
        jobs: list[LoadJob],
        fences: tuple[Any, ...] = (),
        stream: Any = None,
    ) -> None:
        started = self.last_times.taken = time.monotonic()
        try:
            with self._device.on(stream):
                wait_fences(stream, fences)
                self.copy_batch(index, jobs, stream)
        except BaseException as exc:
            logger.exception("KVCR restore copy failed; its requests are aborted")
            try:
                drain(stream)  # queued writes land before the slots are given back
            except BaseException:
                logger.exception("KVCR restore stream could not be drained")
            self._pause()
            self.counter.fail(index, exc)
            return
        self._failures = 0  # a batch landed: restores run normally
        copied_s = time.monotonic() - started  # each request waited the whole batch
        for job in jobs:
            if job.complete:
                self.stats.samples.add(Sample.RESTORE_COPY, copied_s)

    def _pause(self) -> None:
        """A copy failed: lookups miss for a while, longer after each failure in
        a row (a device fault should not turn every later restore into one)."""
        self._failures += 1
        self.stats.restore_copy_failures += 1
        pause = min(RESTORE_PAUSE_MAX_S, RESTORE_PAUSE_S * 2 ** (self._failures - 1))
        self._paused_until = time.monotonic() + pause
        logger.error("KVCR restores paused for %.0f s after a failed copy", pause)

    def copy_batch(self, index: int, jobs: list[LoadJob], stream: Any) -> None:
        jobs = [job for job in jobs if job.complete]
        moves = {}  # pool name -> (destination pages, source slots) of the batch
        for pool in self.layout.pools:
            parts = [job for job in jobs if job.slots[pool.name]]
            if parts:
                moves[pool.name] = (
                    torch.cat([job.dest_pages[pool.name] for job in parts]),
                    [s for job in parts for s in job.slots[pool.name]],
                )
        if self.span_restore is not None:
            # Whole slot runs per pool, every layer at once (see SpanRestore);
            # layers complete when the stream has drained.
            for name, (dest, slots) in moves.items():
                store, *targets = word_rows(
                    self._dram.storage[name].view(-1, self._page_bytes[name]),
                    *self.dest_rows[name],
                )
                self.span_restore.copy_pool(targets, dest, store, slots)
            self.last_times.issued = time.monotonic()
            drain(stream)
            self.last_times.drained = time.monotonic()
            self.span_restore.drained()
            for layer in range(self.layout.num_layers):
                self.counter.complete(index, layer)
            return
        plans = [
            CpuRestorePlan(dest, slots, self._rows_of(name), self._dram.storage[name])
            for name, (dest, slots) in moves.items()
        ]
        # Inline on the scheduler thread: the forward cannot start before every
        # layer is in place anyway, so the layers complete together.
        if self.team is None:
            for plan in plans:
                plan.copy()
        else:
            self.team.run([piece for plan in plans for piece in plan.pieces()])
        self.last_times.issued = time.monotonic()  # CPU: the copy itself, done
        for layer in range(self.layout.num_layers):
            self.counter.complete(index, layer)

    def _rows_of(self, name: str) -> SpanRows:
        rows = self._span_rows.get(name)
        if rows is None:
            rows = self._span_rows[name] = span_rows(self.dest_rows[name])
        return rows
