"""Stored marks and EXTERNAL KV events for the pages KVCR holds.

When an offload commits, SGLang marks its nodes ``external_cache_stored`` and this
plugin publishes ``BlockStored`` (medium EXTERNAL) for their pages. When KVCR
evicts a page, the node's mark must clear (so the node is offloaded again) and
routers must hear ``BlockRemoved`` for exactly that page. ``StoredPages`` (one per
publishing linker, kept by ``integration``) maps each announced page to its node —
the node itself, since its pages stay in KVCR after the device drops it — and
remembers evictions that arrive before their page's offload has committed, so
the commit does not leave a stale mark. ``gather_union`` makes every attention
rank clear the same marks: one MAX all-reduce a step, the object gather only when
some rank has evictions to announce.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import torch

from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    cache_linker_of,
    linker_hook,
)

# Evictions remembered for offloads still committing (oldest dropped first).
MAX_EARLY_REMOVALS = 1 << 16


class StoredPages:
    """Announced pages by hash, and evictions that came before their commit."""

    def __init__(self) -> None:
        self.by_hash: dict[str, Any] = {}  # page hash -> radix node holding it
        self._early: collections.OrderedDict[str, bool] = collections.OrderedDict()

    def index(self, node: Any) -> list[str]:
        """Index ``node``'s pages (its offload committed); returns those KVCR
        already evicted (the list every rank gathered): their mark is stale."""
        evicted = []
        for page_hash in node.hash_value or ():
            self.by_hash[page_hash] = node
            if self._early.pop(page_hash, False):
                evicted.append(page_hash)
        return evicted

    def clear(self, core: Any, page_hashes: list[str]) -> int:
        """Clear ``external_cache_stored`` for nodes holding evicted pages and
        publish EXTERNAL ``BlockRemoved`` for exactly those pages; returns nodes
        cleared. A page not indexed yet is remembered until its commit."""
        from sglang.srt.disaggregation.kv_events import StorageMedium

        cleared = 0
        evicted_at: dict[int, tuple[Any, list[int]]] = {}
        for page_hash in page_hashes:
            node = self.by_hash.pop(page_hash, None)
            if node is None:
                self._early[page_hash] = True
                while len(self._early) > MAX_EARLY_REMOVALS:
                    self._early.popitem(last=False)
                continue
            # A split moves a node's leading pages (and its stored mark) into a
            # new parent with a new id: the page now lives in an ancestor.
            while node is not None and page_hash not in (node.hash_value or ()):
                node = node.parent
            if node is None:
                continue
            # A node the device already dropped still gets its EXTERNAL removal.
            if node.external_cache_stored:
                node.external_cache_stored = False
                cleared += 1
            entry = evicted_at.setdefault(id(node), (node, []))
            entry[1].append(node.hash_value.index(page_hash))
        for node, positions in evicted_at.values():
            publish_removed(
                core.kv_events, node, sorted(positions), StorageMedium.EXTERNAL
            )
        return cleared

    def reset(self) -> None:
        self.by_hash.clear()
        self._early.clear()


def committed(core: Any, node: Any, stored: StoredPages | None) -> list[str]:
    """Publish EXTERNAL ``BlockStored`` for a node whose offload committed and
    index it; returns its pages KVCR evicted before the commit."""
    from sglang.srt.disaggregation.kv_events import StorageMedium

    core.kv_events.record_store(node, medium=StorageMedium.EXTERNAL)
    return [] if stored is None else stored.index(node)


def publish_removed(
    recorder: Any, node: Any, positions: list[int], medium: Any
) -> None:
    """``BlockRemoved`` for the pages of ``node`` at ``positions`` only, with the
    hashes SGLang's recorder publishes for them (namespaced like its stores)."""
    from sglang.srt.disaggregation.kv_events import BlockRemoved
    from sglang.srt.mem_cache.events import KVCacheEventRecorder

    if not recorder.enabled:
        return
    scratch = KVCacheEventRecorder(
        enabled=True,
        page_size=recorder.page_size,
        dynamo_format=recorder.dynamo_format,
        lora_names=recorder.lora_names,
    )
    scratch.record_remove(node, medium=medium)
    hashes = [h for event in scratch.take() for h in event.block_hashes]
    picked = [hashes[i] for i in positions if i < len(hashes)]
    if picked:
        recorder.enqueue(BlockRemoved(block_hashes=picked, medium=medium))


def reduce_groups(cache: Any) -> list[Any]:
    """The groups ``_all_reduce_attn_groups`` reduces over, in its order: the
    attention CP and TP groups of more than one rank, else the TP group when
    it has more than one; none on a single attention rank."""
    groups = [g for g in (cache.attn_cp_group, cache.attn_tp_group) if g is not None]
    groups = [g for g in groups if torch.distributed.get_world_size(group=g) > 1]
    if not groups and cache.tp_world_size > 1:
        groups = [cache.tp_group]
    return groups


def gather_union(cache: Any, removed: list[str]) -> list[str]:
    """The union of every attention rank's removed hashes (same list on all).

    Uses the groups ``_all_reduce_attn_groups`` reduces over, so the ranks that
    pair offload results by position agree on which stored marks to clear.
    """
    merged = set(removed)
    if not torch.distributed.is_initialized():
        return sorted(merged)
    groups = reduce_groups(cache)
    if not groups:
        return sorted(merged)
    # One small reduction per step; the object gather only when some rank has
    # something to announce (every rank sees the same maximum).
    count = torch.tensor([len(merged)], dtype=torch.int64)
    for group in groups:
        torch.distributed.all_reduce(count, torch.distributed.ReduceOp.MAX, group)
    if int(count[0]) == 0:
        return []
    for group in groups:
        gathered: list[Any] = [None] * torch.distributed.get_world_size(group=group)
        torch.distributed.all_gather_object(gathered, sorted(merged), group=group)
        for part in gathered:
            merged.update(part or ())
    return sorted(merged)


# What each publishing linker's EXTERNAL events announced, kept here beside the
# tree marks they mirror (the linker never reads them).
_STORED: weakref.WeakKeyDictionary[Any, StoredPages] = weakref.WeakKeyDictionary()


def stored_pages(backend: Any) -> StoredPages | None:
    """The stored marks ``backend`` announced; None for a linker publishing none."""
    if backend is None or not linker_hook(backend, "publishes_external_events"):
        return None
    pages = _STORED.get(backend)
    if pages is None:
        pages = _STORED[backend] = StoredPages()
    return pages


def clear_stored_marks(cache: Any, page_hashes: list[str]) -> int:
    """Clear the stored marks of ``page_hashes`` KVCR evicted; how many."""
    stored = stored_pages(cache_linker_of(cache))
    if stored is None:
        return 0
    return stored.clear(cache.tree_core, page_hashes)


def node_or_none(core: Any, node_id: Any) -> Any:
    """The tree node ``node_id``; None once the tree dropped it."""
    try:
        return core.node_by_id(node_id)
    except (KeyError, IndexError):
        return None
