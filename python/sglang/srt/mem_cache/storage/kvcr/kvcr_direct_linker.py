"""KVCRDirectLinker: SGLang 0.5.23's UnifiedCacheLinker contract backed by KVCR.

This module wires the collaborators and routes results; each owns its state:
``preparation`` (which pages of a request are claimed in KVCR DRAM),
``residency`` (what KVCR holds), ``offloader``/``offload_queue`` (write-through
deposits and their FIFO results), ``restore`` (load planning and the copy),
``quarantine`` (DRAM shares through flushes) and ``linker_stats``; ``builder``
builds it from the rank's ``rank_setup.LinkerSetup``. Every KVCR call
runs on the adapter's owner thread; this class runs on the scheduler thread,
submits the commands the collaborators return and drains typed results in
``_pump``. A request's tail is *prepared*: pages resident here or named by a
``kv.fetch`` hint are fetched into local KVCR DRAM, and each page that lands holds
a claim. ``lookup`` reports only pages whose claims are held, so a hint alone is
never a hit and a failed transfer is a miss, never wrong KV. The lifecycle
(flush, close, and recovery when KVCR fails: lookups miss and offloads fail
until a restart brings a new KVCR) is ``linker_lifecycle.LinkerLifecycle``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from sglang.srt.mem_cache.hicache_storage import PoolTransfer
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    UnifiedCacheLinker,
)

from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRUnavailableError
from sglang.srt.mem_cache.storage.kvcr.datapath.offloader import Offloader
from sglang.srt.mem_cache.storage.kvcr.datapath.restore import Restorer, plan_transfers
from sglang.srt.mem_cache.storage.kvcr.fleet.router_hint import (
    RouterHintParser,
    request_hint,
)
from sglang.srt.mem_cache.storage.kvcr.linker_lifecycle import LinkerLifecycle
from sglang.srt.mem_cache.storage.kvcr.observability import linker_metrics
from sglang.srt.mem_cache.storage.kvcr.observability.linker_stats import (
    Gauges,
    KVCRGauges,
    LinkerStats,
    StatsReport,
    snapshot,
)
from sglang.srt.mem_cache.storage.kvcr.owner.idle_freeze import IdleFreezer
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import (
    InventoryChange,
    OpDone,
    OpKind,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_session import KVCRSession
from sglang.srt.mem_cache.storage.kvcr.owner.recovery import Recovery
from sglang.srt.mem_cache.storage.kvcr.rank_setup import LinkerSetup
from sglang.srt.mem_cache.storage.kvcr.requests.claimed_pages import PrepState
from sglang.srt.mem_cache.storage.kvcr.requests.fetch_plan import kv_keys, window_pages
from sglang.srt.mem_cache.storage.kvcr.requests.preparation import Preparations
from sglang.srt.mem_cache.storage.kvcr.requests.residency import Residency
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
    PreparationHandle,
    PreparationHooks,
    VerdictsPerRequest,
)

__all__ = ["KVCRDirectLinker"]

NOT_BUILT_BY_PLUGIN = (
    "KVCRDirectLinker is built by the sglang-kvcr plugin's linker hook "
    "(builder.build_linker), which did not run in this process: install "
    "sglang-kvcr in this environment and, if SGLANG_PLUGINS is set, add kvcr to "
    "it; then pass --unified-cache-external-linker-backend kvcr (or the dynamic "
    "route naming KVCRDirectLinker)"
)

logger = logging.getLogger(__name__)


class KVCRDirectLinker(
    LinkerLifecycle, VerdictsPerRequest, PreparationHooks, UnifiedCacheLinker
):
    """Direct external linker over a real KVCR (see the module docstring)."""

    prepares_requests = True
    publishes_external_events = True

    def __init__(self, setup: LinkerSetup, *sglang_args: Any, **sglang_kw: Any) -> None:
        """Built by ``builder.build_linker`` (the plugin's linker hook) only."""
        if not isinstance(setup, LinkerSetup) or sglang_args or sglang_kw:
            raise KVCRUnavailableError(NOT_BUILT_BY_PLUGIN)
        self.config = cfg = setup.config
        self.forward_stream = setup.forward_stream
        self.page_size = setup.page_size
        rank, res = setup.rank, setup.resources
        self.replicas = setup.replicas
        self.placement, self.layout = rank.placement, rank.layout
        self.weights, self.pools = rank.weights, rank.pools
        self.num_layers = self.layout.num_layers
        self.layer_done_counter = setup.counter
        self._device = setup.device
        # Deposits wait on events after the writing batch (none on CPU: no async).
        self._ready_events = (
            self.record_offload_ready if self._device.is_cuda else tuple
        )
        session = None
        try:  # a start-up that fails gives back what it took
            self.dram = res.dram
            self.copier = res.copier
            self.stats = LinkerStats()
            self.report = StatsReport(
                self.stats_snapshot,
                linker_metrics.build(
                    setup.server_args,
                    self.page_size,
                    self.stats.samples,
                    self.stats_snapshot,
                ),
            )
            self.hints = RouterHintParser.from_config(cfg, self.placement.shard_rank)
            self._local_wait_s = cfg.local_hit_wait_ms / 1000.0  # this step's
            self._lookups_reduced = True  # until bound: every restorable length
            self._idle_wait_s = cfg.idle_offload_wait_us / 1e6
            self.freezer = IdleFreezer(cfg.gc_freeze_pages, self.stats)
            # Claims of waiting requests: max_claimed_bytes (0: half the share).
            self.preparations = Preparations(
                self.stats,
                cfg.max_claimed_bytes or self.dram.gauges().dram_bytes // 2,
            )
            self.recovery = Recovery()
            self.residency = Residency(self.layout)
            self.offloader = Offloader(
                layout=self.layout,
                page_size=self.page_size,
                staging=res.staging,
                device=self._device,
                stats=self.stats,
                timeout_s=cfg.operation_timeout_ms / 1000.0,
                hold_batches=cfg.offload_hold_batches,
                idle_delay_s=cfg.idle_offload_delay_us / 1e6,
            )
            self.session = session = KVCRSession.for_rank(
                cfg, self.placement, self.layout, self.dram, res.copier
            )
            session.log_up(self.placement, self.layout)
            self.restorer = Restorer(  # last: it stops its own threads if it fails
                layout=self.layout,
                device=self._device,
                dram=self.dram,
                dest_rows=res.dest_rows,
                counter=self.layer_done_counter,
                stats=self.stats,
                span_restore=res.span,
                name=f"kvcr-loader-{self.placement.label()}",
            )
        except BaseException:
            adapter = None if session is None else session.adapter
            res.release(cfg.owner_wait_timeout_s, adapter)
            raise

    # ---- lifecycle (flush, close, recovery: linker_lifecycle) -------------------

    @property
    def endpoint(self) -> str:
        """This rank's KVCR peer control endpoint (what a router's hint names)."""
        return self.session.endpoint

    @property
    def _refusing_pages(self) -> bool:
        """No page is stored or fetched now: pages of new weights would be keyed
        as old ones, a disabled linker has no DRAM, a down one no KVCR."""
        return self.weights.pending or self.dram.disabled or self.recovery.down

    # ---- result routing --------------------------------------------------------

    def _pump(self, may_restart: bool = False, deposits: bool = True) -> None:
        self._route(deposits=deposits)
        self._watch_kvcr(may_restart)  # failed: go down; down: restart when due

    def _route(self, wait_s: float = 0.0, deposits: bool = True) -> None:
        if deposits and self.offloader.queue.has_deferred:
            self.offloader.submit_ready(self._adapter)
        for item in self._adapter.drain(wait_s):
            if isinstance(item, InventoryChange):
                self.stats.evicted_pages += self.residency.on_inventory(item)
            elif isinstance(item, OpDone) and item.kind is OpKind.DEPOSIT:
                self.offloader.on_done(item)
            else:
                self.session.submit(
                    self.preparations.on_fetch_done(item, self.residency.parse_key)
                )
        self.report.tick()

    # ---- preparation -------------------------------------------------------------

    def prepare_request(
        self, ctx: LinkerRequestContext, transfers: list[PoolTransfer]
    ) -> PreparationHandle:
        """Fetch the tail's locally resident or hinted pages into claimed KVCR DRAM
        (at enqueue: the last batch's deferred offloads wait for the step's pump,
        so no deposit runs on the owner thread ahead of this request's claims)."""
        self._pump(deposits=False)
        page_hashes = kv_keys(transfers)
        hint = request_hint(
            self.hints,
            ctx,
            page_hashes,
            self.session.own_endpoints,
            self.dram.peer_fetches_off,
            self.placement.multi_node,
            self.stats,
            ctx.kv_hints is not None and self._fills_unresolved(),
        )
        commands = self.preparations.prepare(
            ctx,
            page_hashes,
            hint,
            self.residency,
            self.layout,
            self.config,
            self._refusing_pages,
            self._adapter.next_op_id,
        )
        if commands:  # a failed KVCR's adapter answers them itself
            self.session.submit(commands)  # then block: the owner takes the GIL
            self._await_local_claims(ctx.rid)
            self._pump(deposits=False)
        return ctx.handle

    def tail_may_hit(self, rid: str, first_page_hash: str) -> bool:
        """Restores are prefix-contiguous: a tail whose first page is not resident
        here restores nothing without a hint. An earlier attempt's preparation
        still takes the full path (which replaces it)."""
        if self.preparations.get(rid) is not None:
            return True
        self._pump(deposits=False)  # what arrived counts, as in prepare_request
        held = self.residency.holds(first_page_hash, self.layout.full_pools)
        self.stats.prepare_skipped += not held
        return held

    def _await_local_claims(self, rid: str) -> None:
        """Claims of pages resident here come at once: wait (a step's waits share
        ``local_hit_wait_ms``) to admit it this pass; the readiness MIN agrees."""
        prep, start = self.preparations.get(rid), time.monotonic()
        while prep and prep.local_only and prep.state is PrepState.FETCHING:
            if (left := self._local_wait_s - (time.monotonic() - start)) <= 0:
                self.stats.local_hit_waits_expired += self._local_wait_s > 0
                break
            self._route(left, deposits=False)
        self._local_wait_s -= time.monotonic() - start

    def _fills_unresolved(self) -> bool:
        """Failed peer fetches hold over max(DRAM share / 4, max_abandoned_bytes):
        no hints until a flush or restart resolves them (unresolved_fills)."""
        held = self._adapter.stats().unresolved_fill_bytes
        bound = max(self.dram.gauges().dram_bytes // 4, self.config.max_abandoned_bytes)
        return held > bound

    def scheduler_idle(
        self, sleeps: bool = False, holds_sessions: Callable[[], bool] | None = None
    ) -> None:
        """Fully idle: deposits in flight end now, then maybe a heap freeze."""
        self.offloader.settle(self._route, self._idle_wait_s, immediate=sleeps)
        self.freeze_when_quiet(holds_sessions)

    def batch_result_started(self) -> None:
        """A batch's result is being processed (its offloads wait for it)."""
        self.offloader.queue.hold.result_started()

    def batch_done(self) -> None:
        """A batch's result is through: deferred offloads' holds count it."""
        self.offloader.queue.hold.result_done()

    def preparation_ready(self, handle: PreparationHandle) -> bool:
        """Whether ``handle``'s attempt may be admitted (by its own preparation)."""
        self._pump()
        return self.preparations.ready(handle)

    def note_admission(self, rids: list[str], ready: list[bool]) -> None:
        self.preparations.note_admission(rids, ready)

    def release_request(self, rid: str) -> None:
        self.session.submit(self.preparations.release(rid))
        self.cancel_queued_load(rid)

    finish_request = release_request

    def take_removed_page_hashes(self) -> list[str]:
        return self.residency.take_removed()

    def abandoned_bytes(self) -> int:
        """Bytes still being fetched for preparations that were dropped."""
        return self.preparations.abandoned_bytes()

    # ---- UnifiedCacheLinker contract ---------------------------------------------

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        self.stats.lookups += 1
        self._pump()
        page_hashes = kv_keys(transfers)
        if not page_hashes:
            return []
        if self.weights.pending:  # KV of other weights
            self.stats.refused_weights_changed += 1
            return []
        if self.recovery.down:  # every rank's MIN then misses alike
            self.stats.miss_kvcr_down += 1
            return []
        if self.restorer.paused or self.dram.disabled:
            self.stats.miss_restore_disabled += 1
            return []
        window = window_pages(transfers, len(page_hashes))
        boundaries, commands = self.preparations.lookup(
            rid, page_hashes, window, self.layout, self.residency
        )
        self.session.submit(commands)
        return boundaries if self._lookups_reduced else boundaries[-1:]

    def lookup_groups(self, groups: int) -> None:
        """A single attention rank's lookup reports its longest length only (SGLang
        marks each reported length in a tensor, one indexed write apiece)."""
        self._lookups_reduced = groups > 0

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        prep = self.preparations.get(rid)
        job = plan_transfers(rid, prep, transfers, self.layout, self.page_size)
        if prep is not None:
            # The job took the claims it restores; the rest (pages the device
            # prefix already has, or past a hit the ranks' MIN cut short) can
            # never be restored now: released, not held until the request ends.
            # Every rank loads the same transfers, so every rank drops it.
            self.session.submit(self.preparations.drop(prep))
        if job is None:
            return False
        # Queued regardless (the answer depends on the transfers only, so every
        # rank agrees); a missing claim fails the job and the wrapper aborts it.
        self.session.release(self.restorer.queue(job, len(kv_keys(transfers))))
        return self.replicas.queue(rid, transfers)

    def start_layer_wise_loading(self) -> int:
        index = self.restorer.start(self.forward_stream)
        wait_s = self.config.owner_wait_timeout_s  # then the group gets the pages
        self.replicas.send(self.layer_done_counter, index, wait_s)
        return index

    def finish_layer_wise_loading_by_request(
        self, counter_index: int
    ) -> dict[str, bool]:
        """Wait for the batch; whether each of its requests' KV landed."""
        verdicts, claims = self.restorer.finish(counter_index)
        self.session.release(claims)
        return self.replicas.settle(counter_index, verdicts)

    def cancel_queued_load(self, rid: str) -> bool:
        claims = self.restorer.cancel(rid)
        self.session.release(claims)
        self.replicas.cancel(rid)
        return claims is not None

    def offload(
        self, transfers: list[PoolTransfer], session_id: str | None = None
    ) -> bool:
        self.offloader.offload(
            transfers,
            self._adapter,
            self._ready_events,
            self._refusing_pages,
        )
        return True

    def num_completed_offloads(self) -> int:
        self._pump(may_restart=True)  # once a step, never between lookup and load
        self._local_wait_s = self.config.local_hit_wait_ms / 1000.0  # per step
        return self.offloader.queue.completed()

    def pop_completed_offload(self) -> bool:
        return self.offloader.queue.pop()

    # ---- stats -----------------------------------------------------------------

    def stats_snapshot(self) -> dict[str, Any]:
        """Every counter and gauge of the stats line, by name (linker_stats)."""
        own = snapshot(
            self.stats, _gauges(self), self.session.stats(), self.hints.stats.as_dict()
        )
        return {**own, **self.replicas.stats_snapshot()}

    def stats_line(self) -> str:
        return self.report.line()


def _gauges(linker: KVCRDirectLinker) -> Gauges:
    """The gauges of ``linker``'s stats line, read now."""
    recovery = linker.recovery
    return Gauges(
        dram=linker.dram.gauges(),
        residency=linker.residency.gauges(),
        preparations=linker.preparations.gauges(),
        inbound_refused=linker.session.inbound_refused(),
        kvcr=KVCRGauges(recovery.failures, recovery.restarts, recovery.down),
    )
