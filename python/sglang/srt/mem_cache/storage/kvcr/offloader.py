"""Offloads: device pages of a write-through into KVCR DRAM, staged or direct.

``Offloader.offload`` turns one write-through's transfers into deposits and puts
its result in the ``OffloadQueue`` at once (results pair by position across
ranks, so every call gets one, failed or not). Staged path (GPU hosts by default):
the pages are copied into page-locked staging slots on the stager's thread, which
submits the deposit after its stream has drained. Direct path: KVCR reads the
device pages itself; the deposit is deferred until fences say the pages are
written and their numbers reached the host, then built (split in two when large)
by a later pump, never waiting on the scheduler thread. Nothing here calls KVCR
except through the adapter's thread-safe ``submit``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

from sglang.srt.mem_cache.storage.kvcr.device_streams import DeviceBinding
from sglang.srt.mem_cache.storage.kvcr.kvcr_adapter import Deposit, OpDone
from sglang.srt.mem_cache.storage.kvcr.kvcr_layout import KVCRLayoutError
from sglang.srt.mem_cache.storage.kvcr.linker_stats import LinkerStats
from sglang.srt.mem_cache.storage.kvcr.offload_queue import (
    DeferredOffload,
    OffloadOutcome,
    OffloadQueue,
    OffloadRecord,
    PoolPages,
    select,
    split_deposits,
    to_host,
)
from sglang.srt.mem_cache.storage.kvcr.offload_staging import HostStaging, StageJob
from sglang.srt.mem_cache.storage.kvcr.restore import covers, page_numbers

logger = logging.getLogger(__name__)


class Offloader:
    """One rank's offload path (see the module docstring)."""

    def __init__(
        self,
        *,
        layout: Any,
        page_size: int,
        staging: HostStaging | None,
        device: DeviceBinding,
        stats: LinkerStats,
        timeout_s: float,
    ) -> None:
        self.layout = layout  # replaced by the linker when a flush re-keys
        self.page_size = page_size
        self.staging = staging
        self.queue = OffloadQueue()
        self.stats = stats
        self._device = device
        self._timeout_s = timeout_s

    def offload(
        self,
        transfers: list[PoolTransfer],
        adapter: Any,
        agent: str,
        ready_events: Callable[[], tuple[Any, ...]],
        refuse: bool,
    ) -> None:
        """Queue one offload's result and start its deposits (``refuse``: store
        nothing, e.g. while new weights are not keyed yet). ``ready_events`` is
        called once the page numbers are computed: its events then follow both
        the batch that wrote the pages and the kernels that computed them."""
        record = self.queue.push()
        self.stats.offloads += 1
        try:
            self._offload(record, transfers, adapter, agent, ready_events, refuse)
        except BaseException:
            # Not queued (the wrapper drops its lock and re-raises): no FIFO slot.
            self.queue.withdraw(record)
            raise

    def _offload(
        self,
        record: OffloadRecord,
        transfers: list[PoolTransfer],
        adapter: Any,
        agent: str,
        ready_events: Callable[[], tuple[Any, ...]],
        refuse: bool,
    ) -> None:
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
        # on the pools' device: nothing here waits for the GPU). Window pools store
        # the SWA transfer's pages (those still holding window KV).
        kv_keys = list(kv.keys)
        ordinal = {h: i for i, h in enumerate(kv_keys)}  # staging ordinal per page
        kv_pages = page_numbers(kv.device_indices, len(kv_keys), step)
        window = by_name.get(PoolName.SWA)
        window_keys: list[str] = []
        window_pages = kv_pages[:0]
        if (
            window is not None
            and window.keys
            and covers(window.device_indices, len(window.keys), step)
        ):
            keep = [j for j, h in enumerate(window.keys) if h in ordinal]
            window_keys = [window.keys[j] for j in keep]
            window_pages = select(
                page_numbers(window.device_indices, len(window.keys), step), keep
            )
        groups = [
            PoolPages(pool, window_keys, window_pages)
            if pool.trailing
            else PoolPages(pool, kv_keys, kv_pages)
            for pool in self.layout.pools
        ]
        groups = [g for g in groups if g.keys]
        record.nbytes = sum(
            self.layout.object_bytes[g.pool.name] * len(g.keys) for g in groups
        )
        self.stats.offload_pages += len(kv_keys)
        events = ready_events()  # after every kernel above, on this stream
        staging = self.staging
        if staging is None:
            # Direct path: built and submitted by a later pump, once the events say
            # the pages are written and their numbers have reached the host (no
            # wait here: this thread has the batch's output to stream).
            host = [dataclasses.replace(g, pages=to_host(g.pages)) for g in groups]
            fences = (*events, *self._device.record_fences(None))
            deadline = time.monotonic() + self._timeout_s
            self.queue.defer(DeferredOffload(record, host, fences, deadline))
            return
        slots = staging.alloc(len(kv_keys))
        if slots is None:
            self.stats.offload_staging_full += 1
            record.fail()  # backpressure: the staging area is full
            return
        try:
            blocks = {
                self.layout.block_key(h, g.pool.name): staging.memory_refs(
                    agent, g.pool, slots[ordinal[h]]
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

    def submit_ready(self, adapter: Any, agent: str) -> None:
        """Submit the direct-path offloads whose pages are ready, in order."""
        for deferred in self.queue.take_ready(time.monotonic()):
            if deferred.record.outcome is not OffloadOutcome.PENDING:
                continue  # timed out waiting for its fences
            try:
                deposits = split_deposits(
                    deferred,
                    self.layout.block_key,
                    agent,
                    self.layout.object_bytes,
                    adapter.next_op_id,
                )
                deferred.record.pending = len(deposits)
                for deposit in deposits:
                    self.queue.track(deposit.op_id, deferred.record)
                # Charged as one: the halves of one offload are admitted together.
                adapter.submit_together(deposits)
            except KVCRLayoutError:
                logger.exception("KVCR offload could not be described; it fails")
                deferred.record.fail()
            except BaseException:
                logger.exception("KVCR offload could not be submitted; it fails")
                deferred.record.fail()

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

    def reset(self, staging_quiet: bool) -> None:
        """Forget every offload (a flush); staging slots come back only when no
        copy can still write them."""
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
