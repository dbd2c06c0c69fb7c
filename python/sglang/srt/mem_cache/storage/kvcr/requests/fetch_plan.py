"""Which pages of a request's tail to fetch into KVCR DRAM, and from where.

The wanted head of a tail is its leading pages that are resident here in every
full-attention pool or named by the request's hint. ``plan_fetches`` splits it
into per-pool ``PoolFetch`` chunks: resident keys only take a claim (no bytes
move, nothing is charged), the rest come from the hinted peer. Trailing pools
(SWA window, Mamba last-page state) are asked only for pages this rank holds in
that pool or the peer may hold. Pure functions over plain values; ``kv_keys``
and ``window_pages`` read SGLang's transfers: a trailing pool's window is its
transfer's key count (``ceil(window / page)`` for SWA, 1 for Mamba's state).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sglang.srt.mem_cache.hicache_storage import PoolName

from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import PageLayout


@dataclasses.dataclass(frozen=True, slots=True)
class PoolFetch:
    """Keys of one pool to fetch for a preparation: resident ones only take a
    claim; the rest move from the hinted peer (and are charged)."""

    keys: tuple[bytes, ...]
    expected_layout: tuple[str, ...]
    page_bytes: int
    moved: bool
    parts: int = 1  # spans per block (its slot's rows of one span's page size)
    pool: str = ""  # the pool's name
    pages: tuple[int, ...] = ()  # each key's page index in the planned pages


def kv_keys(transfers: list[Any]) -> list[str]:
    """The page hashes of the KV transfer (the tail's pages), in order."""
    for transfer in transfers:
        if transfer.name == PoolName.KV:
            return list(transfer.keys or [])
    return []


def window_pages(transfers: list[Any], tail_pages: int) -> dict[str, int]:
    """Trailing pages each non-KV transfer needs, by its name: the SWA lookup
    transfer carries the tail's last ``ceil(window / page)`` keys (all of them
    when the tail is shorter), Mamba's the last page's. A trailing pool whose
    transfer is absent needs every page (``trailing_window``)."""
    return {
        str(t.name): min(len(t.keys), tail_pages)
        for t in transfers
        if t.name != PoolName.KV and t.keys
    }


def trailing_window(windows: dict[str, int] | int, source: str, tail: int) -> int:
    """The window of ``source``'s pools (``windows`` from ``window_pages``; a
    plain number is one window for every source); ``tail`` when not given."""
    if isinstance(windows, int):
        return windows
    return windows.get(source, tail)


def plan_fetches(
    pages: list[str],
    hinted: frozenset[str],
    residency: Any,
    layout: PageLayout,
    object_bytes: dict[str, int],
    chunk: int,
) -> list[PoolFetch]:
    """The pool fetches that claim ``pages`` (the wanted head of a tail), in
    chunks of ``chunk`` pages: per pool, resident keys (a claim only) then the
    rest (from the hinted peer). Window pools (SWA) only where this rank or the
    hinted peer may hold them: a missing window page narrows the restorable set,
    it never blocks it."""
    windows = {
        pool.name: {h for h in pages if h in hinted or residency.holds(h, (pool,))}
        for pool in layout.window_pools
    }
    out: list[PoolFetch] = []
    for start in range(0, len(pages), chunk):
        span = range(start, min(start + chunk, len(pages)))
        for pool in layout.pools:
            held = windows.get(pool.name)
            chosen = span if held is None else [i for i in span if pages[i] in held]
            local: list[tuple[int, bytes]] = []
            remote: list[tuple[int, bytes]] = []
            for i in chosen:
                k = layout.block_key(pages[i], pool.name)
                (local if k in residency else remote).append((i, k))
            for group, moved in ((local, False), (remote, True)):
                if group:
                    out.append(
                        PoolFetch(
                            tuple(k for _, k in group),
                            (pool.block_label,),
                            object_bytes[pool.name],
                            moved,
                            len(pool.spans),
                            pool.name,
                            tuple(i for i, _ in group),
                        )
                    )
    return out


def wanted_pages(
    page_hashes: list[str], hinted: frozenset[str], residency: Any, full_pools: Any
) -> int:
    """How many leading pages are resident here (in every full pool) or hinted."""
    wanted = 0
    for page_hash in page_hashes:
        if not residency.holds(page_hash, full_pools) and page_hash not in hinted:
            break
        wanted += 1
    return wanted


def restorable_boundaries(
    prep: Any,
    start: int,
    tail: list[str],
    layout: PageLayout,
    windows: dict[str, int] | int,
) -> list[int]:
    """Boundaries of ``tail`` restorable from ``prep``'s claims under every hit
    policy: full pools for all pages, and each trailing source's pools (SWA,
    Mamba) for its window's last pages; the intersection over the sources."""
    if not layout.window_groups:
        return list(prep.restorable(start, tail, layout.full_names, frozenset(), 0))
    common: set[int] | None = None
    for source, names in layout.window_groups:
        width = trailing_window(windows, source, len(tail))
        found = set(prep.restorable(start, tail, layout.full_names, names, width))
        common = found if common is None else common & found
    return sorted(common or ())
