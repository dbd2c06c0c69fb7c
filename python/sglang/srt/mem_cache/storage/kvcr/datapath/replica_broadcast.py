"""Rank-replicated pools stored once: the restore broadcast from the owning rank.

MLA and DSA pools hold the same KV on every attention-TP rank
(``PageLayout.rank_replicated``), so with attention TP > 1 one rank of the group,
attention-TP rank 0 (the *owner*), offloads, holds the pages in its KVCR and
restores them, and the others (*followers*, ``replica_follower``) hold nothing and
receive every restored page through ``torch.distributed.broadcast`` over the
attention group: the gloo group SGLang's cache reduces over for CPU pools, an NCCL
group over the same ranks for CUDA pools (SGLang's MLA dedup broadcaster uses the
same primitive). ``ReplicaBroadcast`` keeps, per queued load, each pool's
destination device pages computed from the load's transfers as
``restore.plan_load`` computes them, so every rank queues the same pages in the
same order whatever its physical slots; a started batch moves one broadcast per
layer (its pools' parts concatenated, in chunks): the owner gathers its restored
rows, followers scatter them into theirs. The owner broadcasts even after a failed
or late copy, so followers never wait on it; its verdict then fails the batch and
the integration's MIN reduction aborts the requests on every rank. The group is
warmed when it is built (``warm_group``): one probe broadcast creates the NCCL
communicator at startup, and every rank's outcome is MIN-reduced over the
attention group's gloo group, so a group that fails on one rank stops the start
on every rank instead of leaving the others an unmatched broadcast while serving.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolTransfer

from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRUnavailableError
from sglang.srt.mem_cache.storage.kvcr.datapath.restore import loadable_sources
from sglang.srt.mem_cache.storage.kvcr.datapath.restore_copy import wide_rows
from sglang.srt.mem_cache.storage.kvcr.device.device_streams import (
    DeviceBinding,
    wait_event,
    wait_fences,
)
from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import PageLayout
from sglang.srt.mem_cache.storage.kvcr.layout.rank_placement import RankPlacement

logger = logging.getLogger(__name__)

# Bytes one broadcast moves at most (a layer of a large batch goes in chunks).
CHUNK_BYTES = 64 << 20
# The start-up probe: the byte the owner sends, and how long its broadcast may
# take on the device (NCCL creates the communicator in it).
PROBE_BYTE = 0xA5
WARMUP_TIMEOUT_S = 120.0


class ReplicaGroupError(KVCRUnavailableError):
    """The replica broadcast group failed its start-up probe on some rank (raised
    on every rank of the attention group, at build)."""


def stores_once(layout: PageLayout, shard_size: int) -> bool:
    """Whether one rank of the attention group stores the pages for all: the
    group is rank-replicated, TP > 1, and every pool needs all pages (trailing
    SWA or Mamba pools keep every rank storing its own)."""
    return (
        bool(layout.rank_replicated)
        and shard_size > 1
        and not any(pool.trailing for pool in layout.pools)
    )


def dram_ranks(placement: RankPlacement, once: bool) -> int:
    """The ranks this node's DRAM is divided by: every attention rank, or only
    the owners when followers hold none (``once``: see ``stores_once``)."""
    if not once:
        return int(placement.ranks_on_node)
    return max(1, placement.ranks_on_node // placement.shard_size)


def dest_rows_of(layout: PageLayout, page_size: int) -> dict[str, list[torch.Tensor]]:
    """Per pool, each part's byte rows (one row a page), as restores write them."""
    from sglang.srt.mem_cache.storage.kvcr.datapath.device_pages import page_rows

    return {
        pool.name: [
            page_rows(t, pool.rows_per_page or page_size, pool.page_bytes)
            for t in pool.tensors
        ]
        for pool in layout.pools
    }


def broadcast_group(params: Any, layout: PageLayout) -> tuple[Any, int]:
    """(group, the owner's global rank) for the broadcast, warmed: the attention
    group the cache reduces over for CPU pools, an NCCL group over its ranks for
    CUDA pools (collective: every rank of the world builds it at the same point).
    ``ReplicaGroupError`` on every rank when the probe failed on any."""
    base = getattr(params, "attn_tp_cache_group", None) or params.tp_cache_group
    ranks = list(torch.distributed.get_process_group_ranks(base))
    device = DeviceBinding.of(layout.pools[0].tensors[0].device)
    group = base
    if device.is_cuda:
        from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import integration

        group = integration.nccl_group_over(base)
    warm_group(group, ranks[0], device, agree_over=base)
    return group, ranks[0]


def warm_group(
    group: Any,
    src: int,
    device: DeviceBinding,
    *,
    agree_over: Any,
    timeout_s: float = WARMUP_TIMEOUT_S,
) -> None:
    """Broadcast one probe byte from global rank ``src`` over ``group`` (NCCL
    creates its communicator now, not in the first restore), then MIN-reduce
    every rank's outcome over ``agree_over`` (a CPU group): a probe that raised,
    stalled past ``timeout_s`` on the device or delivered another byte on any
    rank raises ``ReplicaGroupError`` on all of them."""
    ok = _probe(group, src, device, timeout_s)
    votes = torch.tensor([1 if ok else 0], dtype=torch.int32)
    torch.distributed.all_reduce(
        votes, op=torch.distributed.ReduceOp.MIN, group=agree_over
    )
    if int(votes.item()) != 1:
        raise ReplicaGroupError(
            "the KVCR replica broadcast group failed its start-up probe on "
            f"{'this rank' if not ok else 'another rank'} of the attention group"
        )
    logger.info("KVCR replica broadcast group warmed (owner: global rank %d)", src)


def _probe(group: Any, src: int, device: DeviceBinding, timeout_s: float) -> bool:
    """This rank's half of the probe broadcast; False when it went wrong."""
    try:
        is_src = torch.distributed.get_rank() == src
        probe = torch.full(
            (1,), PROBE_BYTE if is_src else 0, dtype=torch.uint8, device=device.device
        )
        torch.distributed.broadcast(probe, src=src, group=group)
        if device.is_cuda:  # host-read only once the device is past it
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device.device))
            wait_event(done, timeout_s)
        got = int(probe.item())
    except Exception:
        logger.exception("KVCR replica broadcast probe failed on this rank")
        return False
    if got != PROBE_BYTE:
        logger.error(
            "KVCR replica broadcast probe delivered %#x, not %#x", got, PROBE_BYTE
        )
        return False
    return True


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
    """A started batch: its requests and, per pool, their pages in queue order."""

    rids: tuple[str, ...]
    pages: dict[str, torch.Tensor]
    count: int  # pages per pool


@dataclasses.dataclass(slots=True)
class BroadcastStats:
    batches: int = 0
    pages: int = 0  # pages sent (owner) or received (follower)
    bytes: int = 0
    failures: int = 0  # batches whose broadcast raised or followed a late copy


class ReplicaBroadcast:
    """Queued loads and their layer broadcasts (see the module docstring)."""

    def __init__(
        self,
        layout: PageLayout,
        dest_rows: dict[str, list[torch.Tensor]],
        group: Any,
        src_global_rank: int,
        is_src: bool,
        page_size: int,
        forward_stream: Any = None,
    ) -> None:
        self.layout = layout
        self.dest_rows = dest_rows
        self.wide = {n: [wide_rows(r) for r in parts] for n, parts in dest_rows.items()}
        self.group = group
        self.src = src_global_rank
        self.is_src = is_src
        self.page_size = page_size
        self.forward_stream = forward_stream
        self.stats = BroadcastStats()
        self._device = DeviceBinding.of(layout.pools[0].tensors[0].device)
        self._queued: dict[str, tuple[dict[str, torch.Tensor], int]] = {}
        self._spoiled: set[int] = set()
        self._layers = [
            [(p, i) for p in layout.pools for i in p.layer_part_indices(layer)]
            for layer in range(layout.num_layers)
        ]
        # One staging buffer for every broadcast, allocated now: a broadcast
        # never allocates, so no rank can fail one half way (an allocation
        # failure on one rank would leave the others in a collective alone).
        widest = max(
            (sum(p.page_bytes for p, _ in parts) for parts in self._layers), default=1
        )
        self._buf = torch.empty(
            max(CHUNK_BYTES, widest), dtype=torch.uint8, device=self._device.device
        )

    # ---- queue (every rank, from the same transfers) ---------------------------

    def queue(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        """Queue ``rid``'s pages; False exactly where ``plan_transfers`` refuses
        the transfers. A later load of the same request replaces it."""
        by_source = loadable_sources(rid, transfers, self.layout, self.page_size)
        if by_source is None:
            return False
        count = len(by_source["kv"].keys or ())
        pages = {}
        for pool in self.layout.pools:
            indices = by_source[pool.indices_from].device_indices
            assert indices is not None  # loadable_sources checked the KV's
            pages[pool.name] = pool.device_pages(indices, count, self.page_size)
        self._queued.pop(rid, None)
        self._queued[rid] = (pages, count)
        return True

    def cancel(self, rid: str) -> bool:
        return self._queued.pop(rid, None) is not None

    def reset(self) -> None:
        self._queued.clear()
        self._spoiled.clear()

    def take(self) -> Batch | None:
        """The queued loads as one batch (queue order); None when none."""
        if not self._queued:
            return None
        queued, self._queued = self._queued, {}
        rids = tuple(queued)
        pages = {
            pool.name: torch.cat([queued[r][0][pool.name] for r in rids])
            for pool in self.layout.pools
        }
        return Batch(rids, pages, sum(count for _, count in queued.values()))

    # ---- owner ---------------------------------------------------------------------

    def send(self, counter: Any, index: int, timeout_s: float) -> None:
        """Broadcast batch ``index`` once its copies are done (or failed, or past
        ``timeout_s``: then its verdicts fail, see ``settle``)."""
        batch = self.take()
        if batch is None:
            return
        layers = counter.futures.get(index, ())
        late = concurrent.futures.wait(layers, timeout=timeout_s).not_done
        if late:
            logger.error(
                "KVCR restore batch %d not copied within %.0f s; broadcasting it "
                "to the attention group anyway and failing its requests",
                index,
                timeout_s,
            )
            self._spoil(index)
        try:
            self.run(batch)
        except Exception:
            logger.exception("KVCR replica broadcast of batch %d failed", index)
            self._spoil(index)

    def settle(self, index: int, verdicts: dict[str, bool]) -> dict[str, bool]:
        """The owner's verdicts for batch ``index``: all False when its broadcast
        failed or followed a late copy."""
        if index in self._spoiled:
            self._spoiled.discard(index)
            return dict.fromkeys(verdicts, False)
        return verdicts

    def _spoil(self, index: int) -> None:
        self._spoiled.add(index)
        self.stats.failures += 1

    # ---- follower ------------------------------------------------------------------

    def receive(self, counter: Any) -> tuple[int, tuple[str, ...]]:
        """Start the queued batch as a counter batch and receive its pages;
        (counter index or -1, its requests). A failed broadcast fails the batch."""
        batch = self.take()
        if batch is None:
            return -1, ()
        index = counter.update_producer()
        try:
            self.run(batch)
        except Exception as exc:
            logger.exception("KVCR replica broadcast of batch %d failed", index)
            self.stats.failures += 1
            counter.fail(index, exc)
            return index, batch.rids
        for layer in range(self.layout.num_layers):
            counter.complete(index, layer)
        return index, batch.rids

    # ---- both ----------------------------------------------------------------------

    def run(self, batch: Batch) -> None:
        """One broadcast per layer (per chunk of pages): the owner gathers its
        rows at its pages, followers scatter what arrives into theirs.

        On CUDA everything is queued on the scheduler's current stream, which the
        batch's forward waits on (SGLang orders its forward stream after it), the
        page tensors were made on it, and it first waits on the forward stream's
        launched work (slots handed out again that a running batch may still
        write): nothing crosses streams and the host never waits. A gather or
        scatter that raises does not stop the broadcasts (every rank makes the
        same calls); the error is raised once they are all done."""
        if self._device.is_cuda:
            current = torch.cuda.current_stream(self._device.device)
            wait_fences(current, self._device.record_fences(self.forward_stream))
        error: Exception | None = None
        for parts in self._layers:
            if parts:
                error = self._layer(parts, batch) or error
        if error is not None:
            raise error
        self.stats.batches += 1
        self.stats.pages += batch.count

    def _layer(self, parts: list[tuple[Any, int]], batch: Batch) -> Exception | None:
        per_page = sum(pool.page_bytes for pool, _ in parts)
        step = max(1, self._buf.numel() // per_page)
        error: Exception | None = None
        for start in range(0, batch.count, step):
            n = min(step, batch.count - start)
            buf = self._buf[: n * per_page]
            moves, offset = [], 0
            for pool, part in parts:
                size = n * pool.page_bytes
                rows, chunk = _same_rows(
                    self.dest_rows[pool.name][part],
                    self.wide[pool.name][part],
                    buf[offset : offset + size],
                    n,
                )
                moves.append((rows, chunk, batch.pages[pool.name][start : start + n]))
                offset += size
            try:
                if self.is_src:
                    self.gather(moves)
            except Exception as exc:  # still broadcast: the followers wait for it
                error = exc
            torch.distributed.broadcast(buf, src=self.src, group=self.group)
            try:
                if not self.is_src:
                    self.scatter(moves)
            except Exception as exc:
                error = exc
            self.stats.bytes += n * per_page
        return error

    @staticmethod
    def gather(moves: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """The owner's rows at its pages into the broadcast buffer."""
        for rows, chunk, pages in moves:
            torch.index_select(rows, 0, pages, out=chunk)

    @staticmethod
    def scatter(moves: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """What arrived into a follower's rows at its pages."""
        for rows, chunk, pages in moves:
            rows.index_copy_(0, pages, chunk)

    def stats_snapshot(self) -> dict[str, Any]:
        """The broadcast's counters under the names the stats line prints."""
        moved = "sent" if self.is_src else "received"
        return {
            "replica_role": "owner" if self.is_src else "follower",
            "replica_owner_rank": self.src,
            "replica_batches": self.stats.batches,
            f"replica_pages_{moved}": self.stats.pages,
            f"replica_bytes_{moved}": self.stats.bytes,
            "replica_failures": self.stats.failures,
        }


def _same_rows(
    rows: torch.Tensor, wide: torch.Tensor, chunk: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A part's rows and its slice of the broadcast buffer as ``n`` rows of one
    element type: the wide one where the slice allows it, else bytes."""
    try:
        return wide, chunk.view(wide.dtype).view(n, wide.shape[1])
    except RuntimeError:  # the slice's offset is not a multiple of the width
        return rows, chunk.view(n, rows.shape[1])


class NoReplicas:
    """What a linker storing its own pages uses instead (every call a no-op)."""

    def queue(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        return True

    def cancel(self, rid: str) -> bool:
        return False

    def reset(self) -> None:
        pass

    def send(self, counter: Any, index: int, timeout_s: float) -> None:
        pass

    def settle(self, index: int, verdicts: dict[str, bool]) -> dict[str, bool]:
        return verdicts

    def stats_snapshot(self) -> dict[str, Any]:
        return {}


NO_REPLICAS = NoReplicas()
