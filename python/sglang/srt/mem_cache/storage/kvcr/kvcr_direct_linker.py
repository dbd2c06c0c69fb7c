"""KVCRDirectLinker: SGLang 0.5.23's UnifiedCacheLinker contract backed by KVCR.

Ownership: every KVCR call runs on the adapter's owner thread; this class runs on
the scheduler thread and only enqueues commands and drains typed results. The
restore copy (claimed KVCR DRAM slots into the request's private device slots,
completing the layer counter layer by layer) runs on a loader thread beside the
forward for GPU pools, and inline at ``start_layer_wise_loading`` for CPU pools. Offloads
are accepted deterministically (results are paired by position across ranks) and
fail through the FIFO result. A request's tail is *prepared*: pages resident here
or named by a ``kv.fetch`` hint are fetched into local KVCR DRAM, and each page
that lands holds a residency claim. ``lookup`` reports only pages whose claims are
held, so a hint alone is never a hit and a failed transfer is a miss, never wrong
KV. Claims are released when the restore lands or the request ends.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import itertools
import logging
import os
import queue
import socket
import threading
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
)

from sglang.srt.mem_cache.storage.kvcr import (
    kvcr_layout,
    linker_stats,
    model_identity,
)
from sglang.srt.mem_cache.storage.kvcr.config import KVCRLinkerConfig
from sglang.srt.mem_cache.storage.kvcr.control_auth import InboundGuard
from sglang.srt.mem_cache.storage.kvcr.device_streams import (
    DeviceBinding,
    drain,
    fences_done,
    wait_fences,
)
from sglang.srt.mem_cache.storage.kvcr.host_memory import HostMemory
from sglang.srt.mem_cache.storage.kvcr.integration import attention_replica
from sglang.srt.mem_cache.storage.kvcr.kvcr_adapter import (
    AdapterLimits,
    Deposit,
    DiscardHint,
    EntryStatus,
    Fetch,
    InventoryChange,
    KVCRAdapter,
    OpDone,
    OpKind,
    Release,
    make_kvcr_factory,
)
from sglang.srt.mem_cache.storage.kvcr.kvcr_layout import KVCRLayoutError
from sglang.srt.mem_cache.storage.kvcr.linker_hooks import (
    LinkerRequestContext,
    PreparationHandle,
    PreparationHooks,
)
from sglang.srt.mem_cache.storage.kvcr.linker_stats import LinkerStats
from sglang.srt.mem_cache.storage.kvcr.offload_staging import HostStaging, StageJob
from sglang.srt.mem_cache.storage.kvcr.plugin import refuse_unsupported_topology
from sglang.srt.mem_cache.storage.kvcr.quarantine import Quarantine
from sglang.srt.mem_cache.storage.kvcr.rank_placement import placement_of
from sglang.srt.mem_cache.storage.kvcr.residency import Residency
from sglang.srt.mem_cache.storage.kvcr.restore_copy import (
    CpuRestorePlan,
    SpanRestore,
    wide_rows,
)
from sglang.srt.mem_cache.storage.kvcr.router_hint import (
    EndpointAllowlist,
    FetchHint,
    RouterHintParser,
    page_hash_to_u64,
)

logger = logging.getLogger(__name__)

_STATS_LOG_PERIOD_S = 30.0
_INCARNATIONS = itertools.count(1)
# A failed restore copy pauses restores (lookups miss) for this long, doubling
# per consecutive failure up to the cap; a batch that lands resets the backoff.
_RESTORE_PAUSE_S = 5.0
_RESTORE_PAUSE_MAX_S = 300.0
# Direct offloads this large go to KVCR as _DEPOSIT_PARTS deposits (see
# _submit_deferred_deposits); smaller ones as one.
_SPLIT_DEPOSIT_BYTES = 64 << 20
_DEPOSIT_PARTS = 2
# Requests the readiness gate holds back, tracked for the admission wait; a
# request that leaves without a release only ages out past this bound.
_MAX_HELD_TRACKED = 4096


class PrepState(enum.Enum):
    FETCHING = "fetching"
    READY = "ready"
    RELEASED = "released"


@dataclasses.dataclass(slots=True)
class Preparation:
    """One request attempt's prepared tail: which pages are claimed in KVCR DRAM."""

    ctx: LinkerRequestContext
    page_hashes: list[str]
    deadline: float
    state: PrepState = PrepState.FETCHING
    started: float = dataclasses.field(default_factory=time.monotonic)
    pending_ops: set[int] = dataclasses.field(default_factory=set)
    # page index -> {pool name: (claim, slot element index per part)}
    landed: dict[int, dict[str, tuple[int, tuple[int, ...]]]] = dataclasses.field(
        default_factory=dict
    )
    hinted: bool = False
    positions: dict[str, int] | None = None  # page hash -> index, built on demand

    def index_of(self, page_hash: str) -> int | None:
        if self.page_hashes and self.page_hashes[0] == page_hash:
            return 0  # the usual case: asked about the tail it was prepared for
        if self.positions is None:
            self.positions = {}
            for i, h in enumerate(self.page_hashes):
                self.positions.setdefault(h, i)
        return self.positions.get(page_hash)

    def restorable(
        self,
        start: int,
        tail: list[str],
        full: frozenset[str],
        window: frozenset[str],
        window_pages: int,
    ) -> list[int]:
        """Every boundary ``b`` of ``tail`` (which starts at prepared page
        ``start``) restorable from claims: ``full`` pools claimed for all ``b``
        pages and ``window`` pools for the last ``window_pages`` of them. Sparse
        when a window page in the middle is missing (0.5.23's restorable-set
        rule); stops where the tail leaves the prepared pages."""
        out: list[int] = []
        last_gap = -1  # latest tail page lacking a window-pool claim
        prepared = self.page_hashes
        for b in range(1, len(tail) + 1):
            index = start + b - 1
            have = self.landed.get(index)
            if (
                have is None
                or not full <= have.keys()
                or index >= len(prepared)
                or prepared[index] != tail[b - 1]
            ):
                break
            if not window <= have.keys():
                last_gap = b - 1
            if last_gap < max(0, b - window_pages):
                out.append(b)
        return out

    def claims(self) -> list[int]:
        return [claim for page in self.landed.values() for claim, _ in page.values()]


@dataclasses.dataclass(slots=True)
class _LoadJob:
    rid: str
    # per KVCR pool: destination device pages (an index tensor on the pools'
    # device, empty unless complete), and slot element indices [page][part]
    dest_pages: dict[str, torch.Tensor]
    slots: dict[str, list[tuple[int, ...]]]
    claims: list[int]
    complete: bool  # every page claimed in every pool; else nothing is copied


@dataclasses.dataclass(slots=True)
class _Held:
    """A request the readiness gate is holding back."""

    since: float  # monotonic time of the first pass that held it
    passes: int = 1


@dataclasses.dataclass(slots=True)
class _Offload:
    """One ``offload()`` call's FIFO result, settled when all its deposits are."""

    nbytes: int = 0
    pending: int = 0  # deposits submitted and not yet completed
    ok: bool = True
    result: bool | None = None

    def fail(self) -> None:
        self.ok, self.result = False, False


@dataclasses.dataclass(frozen=True, slots=True)
class _PoolPages:
    """The pages one offload stores in one KVCR pool: page hashes and their device
    page numbers (a tensor; on the host once a direct offload is deferred)."""

    pool: Any
    keys: list[str]
    pages: torch.Tensor


@dataclasses.dataclass(frozen=True, slots=True)
class _DeferredOffload:
    """A direct-path offload waiting for its fences (pages written, numbers on
    the host) before its deposits are built."""

    record: _Offload
    groups: list[_PoolPages]
    fences: tuple[Any, ...]
    deadline: float  # past it with fences pending, the offload fails


class KVCRDirectLinker(PreparationHooks, UnifiedCacheLinker):
    """Direct external linker over a real KVCR (see the module docstring)."""

    prepares_requests = True
    publishes_external_events = True

    def __init__(
        self,
        server_args: Any,
        params: Any,
        *,
        components: Any,
        extra_config: dict[str, Any] | None = None,
        forward_stream: Any = None,
    ) -> None:
        self.config = KVCRLinkerConfig.from_dict(extra_config or {})
        cfg = self.config
        refuse_unsupported_topology(server_args)
        self.forward_stream = forward_stream
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.page_size = int(params.page_size)
        shard_rank, shard_size = _attn_rank(params)
        self.placement = placement_of(
            server_args, shard_rank, shard_size, *attention_replica(server_args)
        )
        identity = kvcache_layout_identity(server_args, shard_rank, shard_size)
        self.layout = kvcr_layout.PageLayout.from_kv_pool(
            kvcache, self.page_size, identity=identity, draft_pool=_draft_pool(params)
        )
        self._identity = identity
        # Set by weights_changing(): the identity of the weights now being served,
        # keyed only by the next reset(); until then every page is refused.
        self._pending_identity: kvcr_layout.ModelIdentity | None = None
        self._load_format = str(getattr(server_args, "load_format", None) or "auto")
        self.pools = _sglang_pools(kvcache, components, self.layout)
        if self.layout.window_pools:
            _refuse_virtual_swa_pages(params.token_to_kv_pool_allocator)
        self._full_pools = self.layout.full_pools
        self._window_pools = self.layout.window_pools
        self._full_names = frozenset(p.name for p in self._full_pools)
        self._window_names = frozenset(p.name for p in self._window_pools)
        self.num_layers = self.layout.num_layers
        self.layer_done_counter = LayerWiseLoadCounter(self.num_layers)
        # The rank's device, captured here on the scheduler thread: side threads
        # start on device 0 and bind to it before touching CUDA.
        self._device = DeviceBinding.of(self.layout.pools[0].tensors[0].device)
        self._is_cuda = self._device.is_cuda
        # KVCR DRAM and staging, locked at exactly their size on GPU hosts.
        self._memory = HostMemory(pin=self._is_cuda)
        # Bytes of one page of each KVCR pool (every part), and across all pools.
        self._pool_page_bytes = {
            p.name: p.page_bytes * len(p.spans) for p in self.layout.pools
        }
        self._page_total = sum(self._pool_page_bytes.values())

        plan = kvcr_layout.plan_capacity(
            self.layout, cfg.local_dram_bytes_per_worker, self.placement.ranks_on_node
        )
        logger.info(
            "KVCR capacity: %d pages per pool, %d bytes unused of the per-rank share",
            plan.pages,
            plan.unused_bytes,
        )
        # Restore destinations: each part's device buffer as one row per page.
        self._dest_rows = {
            pool.name: [
                _page_rows(t, self.page_size, pool.page_bytes) for t in pool.tensors
            ]
            for pool in self.layout.pools
        }
        self._wide_dest = {
            name: [wide_rows(rows) for rows in parts]
            for name, parts in self._dest_rows.items()
        }
        self._agent = ""
        try:
            # KVCR-owned DRAM; locked on GPU hosts so restores are asynchronous.
            self._storage = {
                pool.name: self._memory.alloc(pool.bytes) for pool in plan.pools
            }
            # CUDA restores move whole slot runs from locked DRAM (restore_copy).
            self._span_restore = (
                SpanRestore(self._device.device, self._memory)
                if self._is_cuda
                else None
            )
            self._staging = self._make_staging()
        except BaseException:
            self._memory.release_all()  # nothing has used them yet
            raise
        self._factory_args: dict[str, Any] = {
            "agent_name": self._agent,
            "pool_layouts": self.layout.kvcr_pool_layouts(),
            "framework_regions": (
                self._staging.region_descriptors()
                if self._staging is not None
                else self.layout.region_descriptors()
            ),
            "local_dram_pools": self.layout.local_dram_regions(
                list(self._storage.values())
            ),
            "key_adapter": kvcr_layout.KeyAdapter(self.layout),
            "control_bind_host": cfg.control_bind_host,
            "control_advertise_host": cfg.advertise_host,
            "control_port": self.placement.control_port(cfg.control_port),
            "operation_timeout_ms": cfg.operation_timeout_ms,
            "abandon_timeout_ms": cfg.abandon_timeout_ms,
            "eviction_policy": cfg.eviction_policy,
            "nixl_progress_thread": cfg.nixl_progress_thread,
            "progress_idle_ms": cfg.progress_idle_ms,
            "inbound_guard": InboundGuard.from_config(cfg),
        }
        self._limits = AdapterLimits(
            max_inflight_offload_bytes=cfg.max_inflight_offload_bytes,
            max_inflight_prepare_bytes=cfg.max_inflight_prepare_bytes,
            wait_timeout_s=cfg.owner_wait_timeout_s,
        )
        self._hints = RouterHintParser(
            EndpointAllowlist.from_config(cfg), rank_offset=self.placement.shard_rank
        )
        self.stats = LinkerStats()
        self._preps: dict[str, Preparation] = {}
        self._held: dict[str, _Held] = {}  # rid -> held by the readiness gate
        self._op_owner: dict[int, tuple[str, int]] = {}  # fetch op -> (rid, bytes)
        self._abandoned: dict[int, int] = {}  # fetch op of a dropped prep -> bytes
        self._offload_fifo: collections.deque[_Offload] = collections.deque()
        self._offload_pending: dict[int, _Offload] = {}  # deposit op -> offload
        # Direct-path offloads built and submitted by a pump once their fences
        # have completed, in order.
        self._deferred_deposits: list[_DeferredOffload] = []
        self.residency = Residency(self.layout)
        self._queued_loads: dict[str, _LoadJob] = {}
        self._staged_slots: dict[int, tuple[int, ...]] = {}  # deposit op -> slots
        self._quarantine = Quarantine(self._memory)  # non-quiescent old cores
        # Set once max_quarantined_cores is reached (or at 0 and the first).
        self._peer_fetches_off = False
        # A failed copy pauses new restores until this monotonic time.
        self._restore_paused_until = 0.0
        self._restore_failures = 0  # consecutive failed batches
        self._batches: dict[int, list[_LoadJob]] = {}
        self._last_stats_log = time.monotonic()
        try:
            self._adapter = self._start_adapter()
        except BaseException:
            if self._staging is not None:
                self._staging.close(cfg.owner_wait_timeout_s)
            self._memory.release_all()
            raise
        self._loader_jobs: queue.SimpleQueue[
            tuple[int, list[_LoadJob], tuple[Any, ...]] | None
        ] = queue.SimpleQueue()
        self._loader = threading.Thread(
            target=self._loader_main,
            name=f"kvcr-loader-{self.placement.label()}",
            daemon=True,
        )
        self._loader.start()
        logger.info(
            "KVCR direct linker up: agent=%s endpoint=%s (DP replica %d, attention "
            "rank %d of %d) digest=%s pools=%s",
            self._agent,
            self.endpoint,
            self.placement.replica,
            self.placement.shard_rank,
            self.placement.shard_size,
            self.layout.compatibility_digest,
            [p.name for p in self.layout.pools],
        )

    # ---- lifecycle ---------------------------------------------------------------

    def _make_staging(self) -> HostStaging | None:
        path = self.config.offload_path
        if path == "direct" or (path == "auto" and not self._is_cuda):
            return None
        pages = max(
            1, min(self.config.max_inflight_offload_bytes // self._page_total, 1 << 16)
        )
        return HostStaging(
            self.layout.pools,
            self._dest_rows,
            pages,
            memory=self._memory,
            device=self._device,
        )

    def _start_adapter(self) -> KVCRAdapter:
        # A fresh NIXL agent name per KVCR incarnation: peers and this process may
        # still remember the previous one after a flush.
        self._agent = (
            f"kvcr-{socket.gethostname()}-{os.getpid()}-{self.placement.label()}"
            f"-{next(_INCARNATIONS)}"
        )
        self._factory_args["agent_name"] = self._agent
        factory = make_kvcr_factory(**self._factory_args)
        return KVCRAdapter(factory, self._limits, name=f"kvcr-{self.placement.label()}")

    @property
    def endpoint(self) -> str:
        """This rank's KVCR peer control endpoint (what a router's hint names)."""
        return self._adapter.endpoint

    def reset(self) -> None:
        """Flush: drop every claim and preparation and rebuild an empty KVCR."""
        loads_quiet = self._quiesce_loads()
        self._deferred_deposits.clear()  # the wrapper fails its pending offloads
        staging_quiet = self._staging is None or self._staging.wait_idle(
            self.config.owner_wait_timeout_s
        )
        self._release_all()
        old = self._adapter
        clean = old.close() and loads_quiet
        # Older cores that have proven quiescent since give their DRAM back.
        if self._quarantine.cores and self._quarantine.reclaim(
            self.config.owner_wait_timeout_s
        ):
            logger.info(
                "KVCR reset: quarantined cores reclaimed; %d bytes still quarantined",
                self._quarantine.bytes(),
            )
        if self._staging is not None and staging_quiet:
            for slots in self._staged_slots.values():
                self._staging.free(slots)
        elif self._staging is not None:  # a copy may still write them: never reuse
            logger.error(
                "KVCR reset: stager busy; %d slot sets retired", len(self._staged_slots)
            )
        self._staged_slots.clear()
        # Operations of the old core never complete here: forget what they owed.
        self._op_owner.clear()
        self._abandoned.clear()
        self._held.clear()
        self._offload_pending.clear()
        if not clean:
            # A transfer may still write the old DRAM: quarantine it with its core
            # and give the new KVCR fresh memory.
            self._quarantine.add(old, self._storage)
            self._storage = {
                name: self._quarantine.take(name, t.numel())
                for name, t in self._storage.items()
            }
            self._factory_args["local_dram_pools"] = self.layout.local_dram_regions(
                list(self._storage.values())
            )
            logger.error(
                "KVCR reset: old core not quiescent; %d bytes quarantined",
                self.quarantined_bytes(),
            )
            if (
                self._quarantine.cores >= self.config.max_quarantined_cores
                and not self._peer_fetches_off
            ):
                self._peer_fetches_off = True
                logger.error(
                    "KVCR: %d bytes quarantined (max_quarantined_cores=%d reached); "
                    "peer fetches are off until a flush finds a quarantined core "
                    "quiescent again; local offload and restore continue",
                    self.quarantined_bytes(),
                    self.config.max_quarantined_cores,
                )
        else:
            for storage in self._storage.values():
                storage.zero_()
        if (
            self._peer_fetches_off
            and self._quarantine.cores < self.config.max_quarantined_cores
        ):
            self._peer_fetches_off = False
            logger.info("KVCR: quarantine back under its bound; peer fetches are on")
        # The wrapper fails its own pending offloads on reset; results queued here
        # would otherwise pair with the next offloads by position.
        self._offload_fifo.clear()
        if self._pending_identity is not None:
            # New weights: a new digest, so no peer (or old page) of the old
            # weights ever matches a key of the new ones.
            self._identity, self._pending_identity = self._pending_identity, None
            self.layout = self.layout.with_identity(self._identity)
            self._factory_args["key_adapter"] = kvcr_layout.KeyAdapter(self.layout)
        self.residency.reset(self.layout)
        self._adapter = self._start_adapter()
        logger.info(
            "KVCR linker reset: residency cleared, endpoint=%s digest=%s",
            self.endpoint,
            self.layout.compatibility_digest,
        )

    def weights_changing(
        self, source: str, model_path: str | None = None, load_format: str | None = None
    ) -> None:
        """The served weights are being replaced (``source``: disk, tensor, ...).

        Until the next ``reset()`` (SGLang's flush after the update) this worker
        restores, fetches and stores nothing; the reset re-keys KVCR with the new
        identity: the checkpoint at ``model_path`` for a disk update of a local
        checkpoint without a draft model, else a version no other worker has.
        """
        identity = self._pending_identity or self._identity
        if model_path is not None and os.path.exists(model_path) and not identity.draft:
            checkpoint = model_identity.weights_fingerprint(
                model_path, identity.revision, load_format or self._load_format
            )
            identity = dataclasses.replace(
                identity, checkpoint=checkpoint, weights_version=""
            )
        else:
            version = model_identity.new_weights_version()
            identity = dataclasses.replace(identity, weights_version=version)
        self._pending_identity = identity
        logger.info(
            "KVCR: weights changing (%s); pages refused until the next flush", source
        )

    @property
    def weights_pending(self) -> bool:
        """Whether new weights are served but KVCR is not re-keyed for them yet."""
        return self._pending_identity is not None

    def close(self) -> None:
        timeout = self.config.owner_wait_timeout_s
        stopped = self._quiesce_loads()
        self._deferred_deposits.clear()
        self._loader_jobs.put(None)
        self._loader.join(timeout)
        if self._loader.is_alive():
            logger.error("KVCR restore loader did not stop within %.1f s", timeout)
            stopped = False
        if self._staging is not None:
            stopped = self._staging.close(timeout) and stopped
        self._release_all()
        self._log_stats(force=True)
        buffers = [*self._storage.values()]
        if self._staging is not None:
            buffers += self._staging.buffers.values()
        if self._adapter.close() and stopped:
            # Nothing can touch the buffers any more: unlock them.
            for buf in buffers:
                self._memory.release(buf)
            if self._span_restore is not None:
                self._span_restore.close()
        else:  # something may still write them: keep them for the process's life
            for buf in buffers:
                self._memory.quarantine(buf)

    def _quiesce_loads(self) -> bool:
        """Finish every started restore batch, bounded by ``owner_wait_timeout_s``;
        False when one is still copying at the deadline (its DRAM and slots may
        still be touched: the caller quarantines the DRAM)."""
        self._queued_loads.clear()
        deadline = time.monotonic() + self.config.owner_wait_timeout_s
        quiet = True
        for index in list(self._batches):
            layers = self.layer_done_counter.futures.get(index, [])
            left = max(0.0, deadline - time.monotonic())
            if concurrent.futures.wait(layers, timeout=left).not_done:
                logger.error("KVCR restore batch %d still copying at shutdown", index)
                self._batches.pop(index, None)
                quiet = False
                continue
            self.finish_layer_wise_loading(index)
        return quiet

    def _release_all(self) -> None:
        claims: list[int] = []
        for prep in self._preps.values():
            claims.extend(prep.claims())
            prep.landed.clear()
            prep.state = PrepState.RELEASED
        self._preps.clear()
        if claims:
            self._adapter.submit(Release(tuple(claims)))
        self._adapter.wait_idle(self.config.owner_wait_timeout_s)
        self._pump()

    # ---- result routing --------------------------------------------------------

    def _pump(self) -> None:
        if self._deferred_deposits:
            self._submit_deferred_deposits()
        for item in self._adapter.drain():
            if isinstance(item, InventoryChange):
                self._on_inventory(item)
            elif item.kind is OpKind.DEPOSIT:
                self._on_offload_done(item)
            else:
                self._on_fetch_done(item)
        self._log_stats()

    def _on_inventory(self, change: InventoryChange) -> None:
        self.stats.evicted_pages += self.residency.on_inventory(change)

    def _on_offload_done(self, done: OpDone) -> None:
        record = self._offload_pending.pop(done.op_id, None)
        slots = self._staged_slots.pop(done.op_id, None)
        if slots is not None and self._staging is not None:
            self._staging.free(slots)
        if record is None:
            return
        record.ok &= all(e.status is EntryStatus.SUCCESS for e in done.entries.values())
        record.pending -= 1
        if record.pending:
            return
        record.result = record.ok  # stored only if every object of it succeeded
        if record.ok:
            self.stats.offloaded_bytes += record.nbytes
        else:
            self.stats.offload_failures += 1

    def _on_fetch_done(self, done: OpDone) -> None:
        owner = self._op_owner.pop(done.op_id, None)
        self._abandoned.pop(done.op_id, None)
        prep = self._preps.get(owner[0]) if owner is not None else None
        late: list[int] = []
        if (
            prep is None
            or prep.state is PrepState.RELEASED
            or done.op_id not in prep.pending_ops  # from an earlier attempt
        ):
            late = [e.claim for e in done.entries.values() if e.claim is not None]
        else:
            prep.pending_ops.discard(done.op_id)
            for key, entry in done.entries.items():
                parsed = self.residency.parse_key(key)
                if entry.status is not EntryStatus.SUCCESS or parsed is None:
                    if entry.claim is not None:
                        late.append(entry.claim)
                    continue
                page_hash, pool = parsed
                index = self._page_index(prep, page_hash)
                if index is None or entry.claim is None or not entry.slots:
                    if entry.claim is not None:
                        late.append(entry.claim)
                    continue
                slots = tuple(int(ref.element_index) for ref in entry.slots)
                prep.landed.setdefault(index, {})[pool] = (entry.claim, slots)
            if logger.isEnabledFor(logging.DEBUG):
                statuses = collections.Counter(
                    e.status.name for e in done.entries.values()
                )
                logger.debug(
                    "KVCR fetch for %s: %s, %d pages landed, %d ops pending",
                    prep.ctx.handle,
                    dict(statuses),
                    len(prep.landed),
                    len(prep.pending_ops),
                )
            if not prep.pending_ops:
                self._mark_ready(prep)
        if late:
            self.stats.late_claims_released += len(late)
            self._adapter.submit(Release(tuple(late)))

    @staticmethod
    def _page_index(prep: Preparation, page_hash: str) -> int | None:
        return prep.index_of(page_hash)

    # ---- preparation -------------------------------------------------------------

    def prepare_request(
        self, ctx: LinkerRequestContext, transfers: list[PoolTransfer]
    ) -> PreparationHandle:
        """Fetch the tail's locally resident or hinted pages into claimed KVCR DRAM."""
        self._pump()
        old = self._preps.get(ctx.rid)
        if old is not None:
            self._drop_prep(old)
        page_hashes = _kv_keys(transfers)
        hint = self._hints.parse(ctx.kv_hints) if ctx.kv_hints is not None else None
        if hint is not None and hint.source_endpoint == self.endpoint:
            # A router naming this very worker: its pages are local residency
            # (fetched below if resident), never a NIXL transfer to itself.
            self.stats.hints_self += 1
            hint = None
        elif hint is not None and self._peer_fetches_off:
            self.stats.hints_quarantine_off += 1  # see max_quarantined_cores
            hint = None
        hinted = _hinted_pages(hint, page_hashes, ctx.event_hashes)
        wanted = 0
        for page_hash in page_hashes:
            if (
                not self.residency.holds(page_hash, self._full_pools)
                and page_hash not in hinted
            ):
                break
            wanted += 1
        deadline = time.monotonic() + self.config.preparation_timeout_ms / 1000.0
        prep = Preparation(ctx, page_hashes, deadline, hinted=hint is not None)
        self._preps[ctx.rid] = prep
        if wanted and self._pending_identity is not None:
            wanted = 0  # pages of the old weights: recompute
        if wanted and self.abandoned_bytes() > self.config.max_abandoned_bytes:
            # Work for requests that went away is still unresolved in KVCR: do not
            # pile more on; this request recomputes.
            self.stats.refused_abandoned += 1
            wanted = 0
        if wanted == 0:
            prep.state = PrepState.READY  # zero-hit fast path: no owner round trip
            return ctx.handle
        self.stats.prepared += 1
        self.stats.prepared_pages += wanted
        # KVCR matches a hint against its keys' storage hashes: name the hinted
        # pages by those, whatever hash the router named them by.
        envelope = (
            FetchHint(
                hint.source_endpoint,
                tuple(page_hash_to_u64(h) for h in page_hashes if h in hinted),
            ).to_kvcr_envelope()
            if hint is not None and hinted
            else None
        )
        chunk = self.config.prepare_chunk_pages
        # Window pools (SWA) only where this rank or the hinted peer may hold them:
        # a missing window page narrows the restorable set, it never blocks it.
        window_set = {
            h
            for h in page_hashes[:wanted]
            if h in hinted or self.residency.holds(h, self._window_pools)
        }
        for start in range(0, wanted, chunk):
            span = page_hashes[start : min(wanted, start + chunk)]
            for pool in self.layout.pools:
                pages = [h for h in span if h in window_set] if pool.trailing else span
                keys = [self.layout.block_key(h, pool.name) for h in pages]
                # Resident keys only take a claim (no bytes move: nothing to
                # charge); the rest come from the hinted peer and are charged.
                local = tuple(k for k in keys if k in self.residency)
                remote = tuple(k for k in keys if k not in self.residency)
                for chunk_keys, moved in ((local, False), (remote, True)):
                    if not chunk_keys:
                        continue
                    op_id = self._adapter.next_op_id()
                    claimed = len(chunk_keys) * self._pool_page_bytes[pool.name]
                    nbytes = claimed if moved else 0
                    prep.pending_ops.add(op_id)
                    # The DRAM it will claim (what an abandoned op still holds).
                    self._op_owner[op_id] = (ctx.rid, claimed)
                    self._adapter.submit(
                        Fetch(
                            op_id=op_id,
                            keys=chunk_keys,
                            request_id=str(ctx.handle),
                            expected_layout=tuple(pool.part_labels),
                            nbytes=nbytes,
                            # Once per request id; the adapter keeps it for the
                            # request's next fetch if this one is refused.
                            hint=envelope if moved else None,
                        )
                    )
                    if moved:
                        envelope = None
        self._pump()
        return ctx.handle

    def _mark_ready(self, prep: Preparation) -> None:
        if prep.state is PrepState.FETCHING:
            waited_ms = (time.monotonic() - prep.started) * 1000.0
            self.stats.prepare_done += 1
            self.stats.prepare_ms_total += waited_ms
            self.stats.prepare_ms_max = max(self.stats.prepare_ms_max, waited_ms)
        prep.state = PrepState.READY

    def preparation_ready(self, handle: PreparationHandle) -> bool:
        """Whether ``handle``'s attempt may be admitted. Only that attempt's own
        preparation can hold it back: a stale handle never reads a newer one."""
        self._pump()
        prep = self._preps.get(handle.rid)
        if (
            prep is None
            or prep.ctx.attempt_id != handle.attempt_id
            or prep.state is not PrepState.FETCHING
        ):
            return True
        if time.monotonic() >= prep.deadline:
            self.stats.prepare_deadline_expired += 1
            self._mark_ready(prep)  # late completions still land or release
            return True
        return False

    def note_admission(self, rids: list[str], ready: list[bool]) -> None:
        """Record one readiness-gate pass: the wait of each request it held back,
        from the first pass that held it to the pass that let it through."""
        held = self._held
        if not held and all(ready):
            return  # the common pass: nothing held before or now
        now = time.monotonic()
        for rid, ok in zip(rids, ready, strict=True):
            if not ok:
                record = held.get(rid)
                if record is not None:
                    record.passes += 1
                    continue
                if len(held) >= _MAX_HELD_TRACKED:
                    del held[next(iter(held))]  # the oldest record goes unmeasured
                held[rid] = _Held(now)
                continue
            released = held.pop(rid, None)
            if released is None:
                continue  # never held: adds nothing
            waited_ms = (now - released.since) * 1000.0
            s = self.stats
            s.admission_held += 1
            s.admission_held_passes += released.passes
            s.admission_wait_ms_total += waited_ms
            s.admission_wait_ms_max = max(s.admission_wait_ms_max, waited_ms)

    def release_request(self, rid: str) -> None:
        self._held.pop(rid, None)
        prep = self._preps.get(rid)
        if prep is not None:
            self._drop_prep(prep)
        job = self._queued_loads.pop(rid, None)
        if job is not None and job.claims:
            self._adapter.submit(Release(tuple(job.claims)))

    def finish_request(self, rid: str) -> None:
        self.release_request(rid)

    def take_removed_page_hashes(self) -> list[str]:
        return self.residency.take_removed()

    def abandoned_bytes(self) -> int:
        """Bytes still being fetched for preparations that were dropped."""
        return sum(self._abandoned.values())

    def _drop_prep(self, prep: Preparation) -> None:
        if self._preps.get(prep.ctx.rid) is prep:
            del self._preps[prep.ctx.rid]
        for op_id in prep.pending_ops:
            owner = self._op_owner.get(op_id)
            if owner is not None:
                self._abandoned[op_id] = owner[1]
        claims = prep.claims()
        prep.landed.clear()
        prep.state = PrepState.RELEASED
        if claims:
            self._adapter.submit(Release(tuple(claims)))
        if prep.hinted:
            self._adapter.submit(DiscardHint(str(prep.ctx.handle)))

    # ---- UnifiedCacheLinker contract ---------------------------------------------

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        self.stats.lookups += 1
        self._pump()
        page_hashes = _kv_keys(transfers)
        if not page_hashes:
            return []
        if self._pending_identity is not None:  # KV of other weights
            self.stats.refused_weights_changed += 1
            return []
        if time.monotonic() < self._restore_paused_until:
            self.stats.miss_restore_disabled += 1
            return []
        prep = self._preps.get(rid)
        if prep is None:
            # Never prepared (it reached the tree without passing the enqueue
            # hook): a miss, never a wait on the scheduler thread.
            first = self.layout.block_key(page_hashes[0], self.layout.pools[0].name)
            if first not in self.residency:
                self.stats.lookup_fast_miss += 1
            else:
                self.stats.miss_unprepared += 1
            return []
        start = self._page_index(prep, page_hashes[0])
        if start is None:  # the device prefix moved past what was prepared
            self.stats.miss_prefix_moved += 1
            self._drop_prep(prep)
            return []
        boundaries = prep.restorable(
            start,
            page_hashes,
            self._full_names,
            self._window_names,
            _window_pages(transfers, len(page_hashes)),
        )
        if not boundaries:
            self.stats.miss_unclaimed += 1
        self.stats.hit_pages += boundaries[-1] if boundaries else 0
        return boundaries

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        by_name = {t.name: t for t in transfers}
        kv = by_name.get(PoolName.KV)
        if kv is None or not kv.keys:
            return False
        window = by_name.get(PoolName.SWA)
        if not _covers(kv.device_indices, len(kv.keys), self.page_size) or (
            window is not None
            and window.keys
            and not _covers(window.device_indices, len(window.keys), self.page_size)
        ):
            # Not queued: the wrapper recomputes this request (the answer depends
            # on the transfers only, so every rank agrees).
            logger.warning("KVCR load for %s: slot indices do not cover its pages", rid)
            return False
        prep = self._preps.get(rid)
        page_hashes = list(kv.keys)
        slots: dict[str, list[tuple[int, ...]]] = {
            p.name: [] for p in self.layout.pools
        }
        claims: list[int] = []
        complete = prep is not None
        # Window pools restore the SWA transfer's pages (the trailing window).
        window_index = (
            {h: j for j, h in enumerate(window.keys or ())}
            if window is not None
            else {}
        )
        if self._window_names and (
            window is None
            or window.device_indices is None
            or not window_index
            or list(window_index) != page_hashes[-len(window_index) :]
        ):
            complete = False  # the window must be the restored pages' trailing ones
        for page_hash in page_hashes:
            index = None if prep is None else self._page_index(prep, page_hash)
            landed = (
                None if prep is None or index is None else prep.landed.pop(index, None)
            ) or {}
            claims.extend(c for c, _ in landed.values())  # all released after delivery
            for pool in self.layout.pools:
                if pool.trailing and page_hash not in window_index:
                    continue
                entry = landed.get(pool.name)
                if entry is None:
                    complete = False
                    continue
                slots[pool.name].append(entry[1])
        # Destination pages stay where SGLang computed them (no host sync): the
        # full pools take the KV transfer's pages in order, window pools the SWA
        # transfer's (its keys are the tail's trailing pages, checked above).
        dest: dict[str, torch.Tensor] = {}
        if complete:
            for pool in self.layout.pools:
                source = window if pool.trailing else kv
                assert source is not None and source.device_indices is not None
                dest[pool.name] = _page_numbers(
                    source.device_indices, len(slots[pool.name]), self.page_size
                )
        # Queued regardless (the answer depends on the transfers only, so every
        # rank agrees); a missing claim fails the batch and the wrapper aborts it.
        self._queued_loads[rid] = _LoadJob(rid, dest, slots, claims, complete)
        self.stats.loads += 1
        self.stats.load_pages += len(page_hashes)
        if not complete:
            self.stats.load_failures += 1
        return True

    def start_layer_wise_loading(self) -> int:
        if not self._queued_loads:
            return -1
        jobs = list(self._queued_loads.values())
        self._queued_loads.clear()
        index = self.layer_done_counter.update_producer()
        self._batches[index] = jobs
        if self._is_cuda:
            # On the loader thread, after the destination indices (current
            # stream) and the launched batch (forward stream: pages freed by
            # overlap scheduling may still be written by it). The batch moves as
            # whole slot runs at DMA speed; its layers complete together.
            fences = self._device.record_fences(self.forward_stream)
            self._loader_jobs.put((index, jobs, fences))
        else:
            # CPU pools: copy now on this thread's intra-op threads. The forward
            # needs the same cores, and a loader thread's own OpenMP team would
            # contend with the scheduler's for them.
            self._run_copy(index, jobs)
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        """The base contract: True only when every load of the batch landed."""
        return all(self.finish_layer_wise_loading_by_request(counter_index).values())

    def finish_layer_wise_loading_by_request(
        self, counter_index: int
    ) -> dict[str, bool]:
        """Wait for the batch; whether each of its requests' KV landed. A load
        whose claims were missing copied nothing and fails alone; a failed copy
        fails every load of the batch (any of its pages may be partial)."""
        jobs = self._batches.pop(counter_index, None)
        if jobs is None:
            return {}
        ok = bool(self.layer_done_counter.finish(counter_index))
        if ok:
            self.stats.restored_bytes += sum(
                len(pages) * self._pool_page_bytes[name]
                for job in jobs
                if job.complete
                for name, pages in job.slots.items()
            )
        claims = [c for job in jobs for c in job.claims]
        if claims:
            self._adapter.submit(Release(tuple(claims)))
        return {job.rid: ok and job.complete for job in jobs}

    def cancel_queued_load(self, rid: str) -> bool:
        job = self._queued_loads.pop(rid, None)
        if job is None:
            return False
        if job.claims:
            self._adapter.submit(Release(tuple(job.claims)))
        return True

    def offload(
        self, transfers: list[PoolTransfer], session_id: str | None = None
    ) -> bool:
        record = _Offload()
        self._offload_fifo.append(record)
        self.stats.offloads += 1
        try:
            return self._offload(record, transfers)
        except BaseException:
            # Not queued (the wrapper drops its lock and re-raises): no FIFO slot.
            if self._offload_fifo and self._offload_fifo[-1] is record:
                self._offload_fifo.pop()
            for op_id in [k for k, v in self._offload_pending.items() if v is record]:
                del self._offload_pending[op_id]
            self._deferred_deposits = [
                d for d in self._deferred_deposits if d.record is not record
            ]
            raise

    def _offload(self, record: _Offload, transfers: list[PoolTransfer]) -> bool:
        by_name = {t.name: t for t in transfers}
        kv = by_name.get(PoolName.KV)
        if (
            kv is None
            or not kv.keys
            or not _covers(kv.device_indices, len(kv.keys), self.page_size)
            or self._pending_identity is not None  # would be keyed as old weights
        ):
            record.fail()  # nothing (or not every page) to read: stored nothing
            return True
        # Per KVCR pool: the page hashes it stores and their device pages (a tensor
        # on the pools' device: nothing here waits for the GPU). Window pools store
        # the SWA transfer's pages (those still holding window KV).
        step = self.page_size
        kv_keys = list(kv.keys)
        ordinal = {h: i for i, h in enumerate(kv_keys)}  # staging ordinal per page
        kv_pages = _page_numbers(kv.device_indices, len(kv_keys), step)
        window = by_name.get(PoolName.SWA)
        window_keys: list[str] = []
        window_pages = kv_pages[:0]
        if (
            window is not None
            and window.keys
            and _covers(window.device_indices, len(window.keys), step)
        ):
            keep = [j for j, h in enumerate(window.keys) if h in ordinal]
            window_keys = [window.keys[j] for j in keep]
            window_pages = _select(
                _page_numbers(window.device_indices, len(window.keys), step), keep
            )
        groups = [
            _PoolPages(pool, window_keys, window_pages)
            if pool.trailing
            else _PoolPages(pool, kv_keys, kv_pages)
            for pool in self.layout.pools
        ]
        groups = [g for g in groups if g.keys]
        nbytes = sum(self._pool_page_bytes[g.pool.name] * len(g.keys) for g in groups)
        self.stats.offload_pages += len(kv_keys)
        record.nbytes = nbytes
        events = tuple(self.record_offload_ready()) if self._is_cuda else ()
        staging = self._staging
        if staging is None:
            # Direct path: built and submitted by a later pump, once the events say
            # the pages are written and their numbers have reached the host (no
            # wait here: this thread has the batch's output to stream).
            host = [dataclasses.replace(g, pages=_to_host(g.pages)) for g in groups]
            fences = (*events, *self._device.record_fences(None))
            deadline = time.monotonic() + self.config.operation_timeout_ms / 1000.0
            self._deferred_deposits.append(
                _DeferredOffload(record, host, fences, deadline)
            )
            return True
        slots = staging.alloc(len(kv_keys))
        if slots is None:
            self.stats.offload_staging_full += 1
            record.fail()  # backpressure: the staging area is full
            return True
        try:
            blocks = {
                self.layout.block_key(h, g.pool.name): staging.memory_refs(
                    self._agent, g.pool, slots[ordinal[h]]
                )
                for g in groups
                for h in g.keys
            }
        except BaseException:
            staging.free(slots)
            raise
        op_id = self._adapter.next_op_id()
        record.pending = 1
        self._offload_pending[op_id] = record
        self._staged_slots[op_id] = slots
        deposit = Deposit(op_id=op_id, blocks=blocks, nbytes=nbytes)
        adapter = self._adapter  # the incarnation these slots' deposit belongs to
        staging.stage(
            StageJob(
                copies=tuple(
                    (g.pool.name, g.pages, tuple(slots[ordinal[h]] for h in g.keys))
                    for g in groups
                ),
                events=events,
                submit=lambda: adapter.submit(deposit),
                fail=lambda exc: adapter.fail_op(deposit),
            )
        )
        return True

    def _submit_deferred_deposits(self) -> None:
        """Submit the direct-path offloads whose pages are ready, in order; one
        whose fences are still pending past its deadline fails in place."""
        ready = 0
        now = time.monotonic()
        for deferred in self._deferred_deposits:
            if not fences_done(deferred.fences):
                if now < deferred.deadline:
                    break
                logger.error("KVCR offload: pages not written in time; it fails")
                deferred.record.fail()
            ready += 1
        batch = self._deferred_deposits[:ready]
        del self._deferred_deposits[:ready]
        for deferred in batch:
            if deferred.record.result is None:
                try:
                    self._submit_deferred(deferred)
                except BaseException:
                    logger.exception("KVCR offload could not be submitted; it fails")
                    deferred.record.fail()

    def _submit_deferred(self, deferred: _DeferredOffload) -> None:
        """Build and submit one ready direct-path offload's deposits. Large ones go
        as ``_DEPOSIT_PARTS`` deposits (window pages with the half their page falls
        in), so KVCR's per-block Python work on the owner thread for the second
        overlaps the copy of the first."""
        record = deferred.record
        kv_group = next(g for g in deferred.groups if not g.pool.trailing)
        order = {h: i for i, h in enumerate(kv_group.keys)}
        parts = _DEPOSIT_PARTS if record.nbytes >= _SPLIT_DEPOSIT_BYTES else 1
        half = -(-len(order) // parts)
        chunks: dict[int, list[tuple[Any, str, int]]] = {}
        for g in deferred.groups:
            for h, p in zip(g.keys, g.pages.tolist(), strict=True):
                chunks.setdefault(order[h] // half, []).append((g.pool, h, p))
        try:
            deposits = [
                Deposit(
                    op_id=self._adapter.next_op_id(),
                    blocks={
                        self.layout.block_key(h, pool.name): pool.memory_refs(
                            self._agent, p
                        )
                        for pool, h, p in chunk
                    },
                    nbytes=sum(self._pool_page_bytes[pool.name] for pool, *_ in chunk),
                )
                for chunk in chunks.values()
            ]
        except KVCRLayoutError:
            logger.exception("KVCR offload could not be described; it fails")
            record.fail()
            return
        record.pending = len(deposits)
        for deposit in deposits:
            self._offload_pending[deposit.op_id] = record
        # Charged as one: the halves of one offload are admitted together.
        self._adapter.submit_together(deposits)

    def num_completed_offloads(self) -> int:
        self._pump()
        n = 0
        for record in self._offload_fifo:
            if record.result is None:
                break
            n += 1
        return n

    def pop_completed_offload(self) -> bool:
        return bool(self._offload_fifo.popleft().result)

    # ---- restore copy (loader thread or inline; touches no KVCR API) -------------

    def _loader_main(self) -> None:
        self._device.bind_thread()  # this thread started on device 0
        stream = self._device.new_stream()
        while True:
            item = self._loader_jobs.get()
            if item is None:
                return
            index, jobs, fences = item
            self._run_copy(index, jobs, fences, stream)

    def _run_copy(
        self,
        index: int,
        jobs: list[_LoadJob],
        fences: tuple[Any, ...] = (),
        stream: Any = None,
    ) -> None:
        try:
            with self._device.on(stream):
                wait_fences(stream, fences)
                self._copy_batch(index, jobs, stream)
        except BaseException as exc:
            logger.exception("KVCR restore copy failed; its requests are aborted")
            try:
                drain(stream)  # queued writes land before the slots are given back
            except BaseException:
                logger.exception("KVCR restore stream could not be drained")
            self._pause_restores()
            self.layer_done_counter.fail(index, exc)
            return
        self._restore_failures = 0  # a batch landed: restores run normally

    def _pause_restores(self) -> None:
        """A copy failed: lookups miss for a while, longer after each failure in
        a row (a device fault should not turn every later restore into one)."""
        self._restore_failures += 1
        self.stats.restore_copy_failures += 1
        pause = min(
            _RESTORE_PAUSE_MAX_S, _RESTORE_PAUSE_S * 2 ** (self._restore_failures - 1)
        )
        self._restore_paused_until = time.monotonic() + pause
        logger.error("KVCR restores paused for %.0f s after a failed copy", pause)

    def _copy_batch(self, index: int, jobs: list[_LoadJob], stream: Any) -> None:
        jobs = [job for job in jobs if job.complete]
        moves = {}  # pool name -> (destination pages, source slots) of the batch
        for pool in self.layout.pools:
            parts = [job for job in jobs if job.slots[pool.name]]
            if parts:
                moves[pool.name] = (
                    torch.cat([job.dest_pages[pool.name] for job in parts]),
                    [s for job in parts for s in job.slots[pool.name]],
                )
        if self._span_restore is not None:
            # Whole slot runs per pool, every layer at once (see SpanRestore);
            # layers complete when the stream has drained.
            for name, (dest, slots) in moves.items():
                store, targets = _word_rows(
                    self._storage[name].view(-1, self._pool(name).page_bytes),
                    self._dest_rows[name],
                )
                self._span_restore.copy_pool(targets, dest, store, slots)
            drain(stream)
            for layer in range(self.num_layers):
                self.layer_done_counter.complete(index, layer)
            return
        plans = {name: CpuRestorePlan(d, s) for name, (d, s) in moves.items()}
        stores = {
            pool.name: wide_rows(self._storage[pool.name].view(-1, pool.page_bytes))
            for pool in self.layout.pools
        }
        for layer in range(self.num_layers):
            for pool in self.layout.pools:
                if pool.name not in moves:
                    continue
                for part in pool.layer_part_indices(layer):
                    plans[pool.name].copy_part(
                        *_same_width(
                            self._wide_dest[pool.name][part], stores[pool.name]
                        ),
                        part,
                    )
            self.layer_done_counter.complete(index, layer)

    def _pool(self, name: str) -> Any:
        return next(p for p in self.layout.pools if p.name == name)

    # ---- stats -----------------------------------------------------------------

    def stats_snapshot(self) -> dict[str, Any]:
        """Every counter and gauge of the stats line, by name (linker_stats)."""
        gauges = linker_stats.Gauges(
            peer_fetches_off=self._peer_fetches_off,
            quarantined_bytes=self.quarantined_bytes(),
            pinned_bytes=self.pinned_bytes(),
            abandoned_bytes=self.abandoned_bytes(),
            resident_keys=len(self.residency),
            claims_held=self.claims_held(),
            inbound_refused=self._factory_args["inbound_guard"].refused,
        )
        return linker_stats.snapshot(
            self.stats, gauges, self._adapter.stats(), self._hints.stats.as_dict()
        )

    def stats_line(self) -> str:
        return linker_stats.stats_line(self.stats_snapshot())

    def _log_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_stats_log >= _STATS_LOG_PERIOD_S:
            self._last_stats_log = now
            logger.info("%s", self.stats_line())

    def pinned_bytes(self) -> int:
        """Host bytes page-locked for KVCR DRAM and staging (0 on CPU hosts)."""
        return self._memory.pinned_bytes

    def quarantined_bytes(self) -> int:
        return self._quarantine.bytes()

    def claims_held(self) -> int:
        return sum(len(p.claims()) for p in self._preps.values())


def _word_rows(
    store: torch.Tensor, parts: list[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Byte rows as 8-byte words when every one of them allows it (device kernels
    move words faster than bytes), else all as bytes."""
    try:
        return store.view(torch.int64), [rows.view(torch.int64) for rows in parts]
    except RuntimeError:  # row size or offset not a multiple of 8
        return store, list(parts)


def _same_width(
    dest: torch.Tensor, store: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Device and store rows with one element type (bytes when widths differ)."""
    if dest.dtype == store.dtype:
        return dest, store
    return dest.view(torch.uint8), store.view(torch.uint8)


def _page_rows(tensor: torch.Tensor, page_size: int, page_bytes: int) -> torch.Tensor:
    """A byte view of a token-slot buffer with one row per page."""
    pages = tensor.shape[0] // page_size
    flat = tensor[: pages * page_size].reshape(-1).view(torch.uint8)
    return flat.view(pages, page_bytes)


def _draft_pool(params: Any) -> Any:
    """The one draft KV pool sharing the target's slots, if any (else None).

    Packed (MTP) and sidecar draft pools are both indexed by the target's token
    slots, so either becomes a ``draft`` KVCR pool keyed per page like ``kv``.
    """
    pools = [
        *getattr(params, "sidecar_draft_device_pools", ()),
        *getattr(params, "mtp_draft_device_pools", ()),
    ]
    if len(pools) > 1:
        raise KVCRLayoutError(
            f"the KVCR linker supports at most one draft KV pool, got {len(pools)} "
            "(--speculative-* settings); use a single draft model layer pool"
        )
    return pools[0] if pools else None


def _sglang_pools(kvcache: Any, components: Any, layout: Any) -> dict[Any, Any]:
    """``self.pools`` for the wrapper (it restores SWA only if SWA is listed).

    Tree components must be FULL, or FULL+SWA over an ``SWAKVPool``: a Mamba
    state is one slot per request, not a page, and has no KVCR form here.
    """
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    kinds = {ComponentType(int(c)) for c in components or ()}
    names = sorted(k.name for k in kinds)
    windowed = bool(layout.window_pools)
    if kinds - {ComponentType.FULL, ComponentType.SWA}:
        raise KVCRLayoutError(
            f"tree components {names}: the KVCR linker restores FULL attention KV "
            "and sliding-window (SWA) KV only; hybrid Mamba/linear-attention models "
            "are not supported (drop --unified-cache-external-linker-backend for "
            "this model)"
        )
    if (ComponentType.SWA in kinds) != windowed:
        raise KVCRLayoutError(
            f"tree components {names} do not match the KV pool "
            f"{type(kvcache).__name__}: SWA needs an SWAKVPool and vice versa"
        )
    if not windowed:
        return {PoolName.KV: kvcache}
    return {PoolName.KV: kvcache.full_kv_pool, PoolName.SWA: kvcache.swa_kv_pool}


def _refuse_virtual_swa_pages(allocator: Any) -> None:
    """The unified memory pool hands out virtual SWA pages; restores write device
    rows directly, so only the static SWA allocator's physical indices are safe."""
    from sglang.srt.mem_cache.allocator.unified_hybrid_swa import (
        UnifiedSWAAllocatorBase,
    )

    if isinstance(allocator, UnifiedSWAAllocatorBase):
        raise KVCRLayoutError(
            f"{type(allocator).__name__}: the KVCR linker restores SWA KV into "
            "physical rows and does not support the unified (virtual-page) memory "
            "pool; drop --enable-unified-memory for this model"
        )


def _window_pages(transfers: list[PoolTransfer], tail_pages: int) -> int:
    """Pages of the trailing window: the SWA lookup transfer carries the tail's
    last ``ceil(window / page)`` keys (all of them when the tail is shorter)."""
    for transfer in transfers:
        if transfer.name == PoolName.SWA and transfer.keys:
            return len(transfer.keys)
    return tail_pages  # no window given: require window KV for every page


def _hinted_pages(
    hint: FetchHint | None,
    page_hashes: list[str],
    event_hashes: tuple[frozenset[int], ...],
) -> frozenset[str]:
    """The tail pages ``hint`` names: by storage hash, or by any hash a worker
    publishes for the page in its KV events (a namespaced request's)."""
    if hint is None:
        return frozenset()
    named = set(hint.block_hashes)
    return frozenset(
        page_hash
        for i, page_hash in enumerate(page_hashes)
        if page_hash_to_u64(page_hash) in named
        or (i < len(event_hashes) and not named.isdisjoint(event_hashes[i]))
    )


def _kv_keys(transfers: list[PoolTransfer]) -> list[str]:
    for transfer in transfers:
        if transfer.name == PoolName.KV:
            return list(transfer.keys or [])
    return []


def _attn_rank(params: Any) -> tuple[int, int]:
    group = getattr(params, "attn_tp_cache_group", None) or getattr(
        params, "tp_cache_group", None
    )
    if group is None or not torch.distributed.is_initialized():
        return 0, 1
    return (
        torch.distributed.get_rank(group),
        torch.distributed.get_world_size(group),
    )


def kvcache_layout_identity(
    server_args: Any, rank: int, size: int
) -> kvcr_layout.ModelIdentity:
    """The model identity a page's compatibility digest covers (model_identity)."""
    fields = model_identity.model_identity_fields(server_args)
    return kvcr_layout.ModelIdentity(tp_rank=rank, tp_size=size, **fields)


def _page_numbers(indices: torch.Tensor, pages: int, page_size: int) -> torch.Tensor:
    """The page numbers of the first ``pages`` pages of a token-slot index tensor,
    computed where the tensor lives (no host sync on CUDA)."""
    return (indices[: pages * page_size : page_size] // page_size).long()


def _covers(indices: torch.Tensor | None, pages: int, page_size: int) -> bool:
    """Whether a transfer's index tensor holds every slot of ``pages`` pages
    (shape metadata only: no host sync)."""
    return indices is not None and indices.numel() >= pages * page_size


def _select(pages: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """``pages[keep]`` without a host sync (a leading run is a plain slice)."""
    if keep == list(range(len(keep))):
        return pages[: len(keep)]
    index = torch.tensor(keep, dtype=torch.long, pin_memory=pages.is_cuda)
    return pages.index_select(0, index.to(pages.device, non_blocking=True))


def _to_host(pages: torch.Tensor) -> torch.Tensor:
    """Start copying ``pages`` to page-locked host memory on the current stream
    (complete once an event recorded after it has); CPU tensors are returned."""
    if not pages.is_cuda:
        return pages
    host = torch.empty(pages.shape, dtype=pages.dtype, pin_memory=True)
    host.copy_(pages, non_blocking=True)
    return host
