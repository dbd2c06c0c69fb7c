"""Offloads: device pages of a write-through into KVCR DRAM, staged or direct.

``Offloader.offload`` turns one write-through's transfers into deposits and puts
its result in the ``OffloadQueue`` at once (results pair by position across
ranks, so every call gets one, failed or not). Direct path (the default): the
deposit is deferred until fences say the pages are written and their numbers
reached the host, then built (split when large) by a later pump, never waiting
on the scheduler thread and never before the batch's output is streamed (with
no fence at all, a CPU pool, the next pump submits it); the copier reads the
pool pages straight into KVCR's slots. Staged path: the pages are first copied
into page-locked staging slots on the stager's thread, which submits the
deposit (read from staging) after its stream has drained. Nothing here calls
KVCR except through the adapter's thread-safe ``submit``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

from sglang.srt.mem_cache.storage.kvcr.datapath.device_pages import covers, page_numbers
from sglang.srt.mem_cache.storage.kvcr.datapath.offload_queue import (
    DeferredOffload,
    OffloadOutcome,
    OffloadQueue,
    PoolPages,
    select,
    split_deposits,
    to_host,
)
from sglang.srt.mem_cache.storage.kvcr.datapath.offload_staging import (
    HostStaging,
    StageJob,
)
from sglang.srt.mem_cache.storage.kvcr.device.device_streams import DeviceBinding
from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import PageLayout
from sglang.srt.mem_cache.storage.kvcr.layout.pool_layout import KVCRLayoutError
from sglang.srt.mem_cache.storage.kvcr.observability.linker_stats import LinkerStats
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import Deposit, OpDone

logger = logging.getLogger(__name__)


class Offloader:
    """One rank's offload path (see the module docstring)."""

    def __init__(
        self,
        *,
        layout: PageLayout,
        page_size: int,
        staging: HostStaging | None,
        device: DeviceBinding,
        stats: LinkerStats,
        timeout_s: float,
        hold_batches: int = 1,
        idle_delay_s: float = 0.0,
    ) -> None:
        self.layout = layout  # re-keyed by reset() after new weights
        self.page_size = page_size
        self.staging = staging
        self.queue = OffloadQueue(hold_batches, idle_delay_s)
        self.stats = stats
        self._device = device
        self._timeout_s = timeout_s

    def offload(
        self,
        transfers: list[PoolTransfer],
        adapter: Any,
        ready_events: Callable[[], Iterable[Any]],
        refuse: bool,
    ) -> None:
        """Queue one offload's result and start its deposits (``refuse``: store
        nothing, e.g. while new weights are not keyed yet). ``ready_events`` is
        called once the page numbers are computed: its events then follow both
        the batch that wrote the pages and the kernels that computed them."""
        record = self.queue.push()
        self.stats.offloads += 1
        try:
            by_name = {t.name: t for t in transfers}
            kv = by_name.get(PoolName.KV)
            step = self.page_size
            if (
                refuse
                or kv is None
                or not kv.keys
                or not covers(kv.device_indices, len(kv.keys), step)
            ):
                record.fail()  # nothing (or not every page) to read: stored nothing
                return
            # Per KVCR pool: the page hashes it stores and their device pages (a tensor
            # on the pools' device: nothing here waits for the GPU), translated as its
            # entry does. Trailing pools store their own transfer's pages (SWA pages
            # still holding window KV, the node's last-page Mamba state).
            kv_keys = list(kv.keys)
            ordinal = {h: i for i, h in enumerate(kv_keys)}  # staging ordinal per page
            groups = [
                self._trailing_pages(pool, by_name, ordinal)
                if pool.trailing
                else PoolPages(
                    pool,
                    kv_keys,
                    _pool_pages(pool, kv.device_indices, len(kv_keys), step),
                )
                for pool in self.layout.pools
            ]
            groups = [g for g in groups if g.keys]
            record.nbytes = sum(
                self.layout.object_bytes[g.pool.name] * len(g.keys) for g in groups
            )
            self.stats.offload_pages += len(kv_keys)
            events = tuple(ready_events())  # after every kernel above, on this stream
            staging = self.staging
            if staging is None:
                # Direct path: built and submitted by a later pump (the scheduler's
                # next loop pass), once the events say the pages are written and
                # their numbers have reached the host. Even with nothing to wait
                # for (a CPU pool) nothing more happens here: this thread has the
                # batch's output to stream, and keying the deposit and waking the
                # owner thread (which then holds the GIL reserving slots) would
                # delay that first token.
                host = [dataclasses.replace(g, pages=to_host(g.pages)) for g in groups]
                fences = (*events, *self._device.record_fences(None))
                now = time.monotonic()
                seq, ready_after = self.queue.hold.stamp()
                self.queue.defer(
                    DeferredOffload(
                        record,
                        host,
                        fences,
                        deadline=now + self._timeout_s,
                        since=now,
                        seq=seq,
                        ready_after=ready_after,
                    )
                )
                return
            slots = staging.alloc(len(kv_keys))
            if slots is None:
                self.stats.offload_staging_full += 1
                record.fail()  # backpressure: the staging area is full
                return
            try:
                blocks = {
                    self.layout.block_key(h, g.pool.name): staging.block_source(
                        g.pool, slots[ordinal[h]]
                    )
                    for g in groups
                    for h in g.keys
                }
            except BaseException:
                staging.free(slots)
                raise
            op_id = adapter.next_op_id()
            record.pending = 1
            self.queue.track(op_id, record, slots)
            deposit = Deposit(op_id=op_id, blocks=blocks, nbytes=record.nbytes)
            staging.stage(
                StageJob(
                    copies=tuple(
                        (g.pool.name, g.pages, tuple(slots[ordinal[h]] for h in g.keys))
                        for g in groups
                    ),
                    events=events,
                    # The incarnation these slots' deposit belongs to.
                    submit=lambda: adapter.submit(deposit),
                    fail=lambda exc: adapter.fail_op(deposit),
                )
            )
        except BaseException:
            # Not queued (the wrapper drops its lock and re-raises): no FIFO slot.
            self.queue.withdraw(record)
            raise

    def _trailing_pages(
        self, pool: Any, by_name: dict[Any, PoolTransfer], ordinal: dict[str, int]
    ) -> PoolPages:
        """The pages of ``pool``'s own transfer among the KV transfer's pages."""
        t = next((t for n, t in by_name.items() if str(n) == pool.indices_from), None)
        step = pool.index_page_size or self.page_size
        if t is None or not t.keys or not covers(t.device_indices, len(t.keys), step):
            return PoolPages(pool, [], torch.empty(0, dtype=torch.long))
        keep = [j for j, h in enumerate(t.keys) if h in ordinal]
        pages = _pool_pages(pool, t.device_indices, len(t.keys), self.page_size)
        return PoolPages(pool, [t.keys[j] for j in keep], select(pages, keep))

    def submit_ready(self, adapter: Any) -> None:
        """Submit the direct-path offloads whose pages are ready, in order."""
        for deferred in self.queue.take_ready(time.monotonic()):
            if deferred.record.outcome is not OffloadOutcome.PENDING:
                continue  # timed out waiting for its fences
            try:
                deposits = split_deposits(
                    deferred,
                    self.layout.block_key,
                    self.layout.object_bytes,
                    adapter.next_op_id,
                )
                deferred.record.pending = len(deposits)
                for deposit in deposits:
                    self.queue.track(deposit.op_id, deferred.record)
                # Charged as one: the halves of one offload are admitted together.
                adapter.submit_together(deposits)
            except BaseException as exc:
                what = "described" if isinstance(exc, KVCRLayoutError) else "submitted"
                logger.exception("KVCR offload could not be %s; it fails", what)
                # Not awaited any more (a pending op would hold off a restart).
                self.queue.untrack(deferred.record)
                deferred.record.fail()

    def settle(
        self,
        route: Callable[[float], object],
        budget_s: float,
        immediate: bool = False,
    ) -> None:
        """The scheduler is idle: while deposits are in flight, block in
        ``route(wait_s)`` (which routes their results) until none is, at most
        ``budget_s`` (``idle_offload_wait_us``). SGLang's idle loop otherwise
        spins holding the GIL, and the owner and copier threads would finish
        the offload during the next request's scheduling, not between requests.
        An error in ``route`` propagates as it does from every other pump (the
        results it drained are not silently lost here). Deferred deposits go
        once ``idle_offload_delay_us`` has passed since their offload, or all of
        them when ``immediate`` (SGLang's idle loop is about to sleep until a request
        comes: a later idle pass would not run before it)."""
        # Idle: no later batch to run the deposits past; once the batch's output
        # has had its head start (idle_offload_delay_us) they go now.
        self.queue.release_idle(time.monotonic(), immediate=immediate)
        if self.queue.has_deferred:
            route(0.0)  # submits them now (before this pass blocks, if it does)
        if budget_s <= 0 or not self.queue.deposits_in_flight:
            return
        start = time.monotonic()
        deadline = start + budget_s
        while self.queue.deposits_in_flight:
            if (left := deadline - time.monotonic()) <= 0:
                break
            route(left)
        self.stats.idle_offload_waits += 1
        self.stats.idle_offload_wait_ms_total += (time.monotonic() - start) * 1e3

    def on_done(self, done: OpDone) -> None:
        record, slots = self.queue.on_done(done)
        if slots is not None and self.staging is not None:
            self.staging.free(slots)
        if record is None:
            return
        if record.outcome is OffloadOutcome.STORED:
            self.stats.offloaded_bytes += record.nbytes
        else:
            self.stats.offload_failures += 1

    def quiesce(self, timeout_s: float) -> bool:
        """Drop deferred offloads (the wrapper fails them at the flush) and wait
        for the stager; whether no staging copy is still running."""
        self.queue.clear_deferred()
        return self.staging is None or self.staging.wait_idle(timeout_s)

    def staging_buffers(self) -> list[Any]:
        """The staging area's host buffers (to keep locked when not quiet)."""
        return [] if self.staging is None else list(self.staging.buffers.values())

    def reset(self, staging_quiet: bool, layout: PageLayout) -> None:
        """Forget every offload (a flush) and key the next ones by ``layout``
        (a new digest after new weights); staging slots come back only when no
        copy can still write them."""
        self.layout = layout
        held = self.queue.reset()
        if self.staging is None:
            return
        if staging_quiet:
            for slots in held:
                self.staging.free(slots)
        else:  # a copy may still write them: never reuse
            logger.error("KVCR reset: stager busy; %d slot sets retired", len(held))

    def close(self, timeout_s: float) -> bool:
        self.queue.clear_deferred()
        return self.staging is None or self.staging.close(timeout_s)


def _pool_pages(pool: Any, indices: Any, pages: int, page_size: int) -> Any:
    """``pool``'s device page numbers of a transfer's first ``pages`` pages, its
    entry's index translation applied (a tensor where the indices live)."""
    if pool.translate is not None:
        indices = pool.translate(indices)
    return page_numbers(indices, pages, pool.index_page_size or page_size)
