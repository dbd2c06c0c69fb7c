"""Describe SGLang KV pools as KVCR blocks, and key those blocks.

Every entry of the model's ``DevicePoolGroup`` (``pool_group_layout``) becomes one
KVCR pool (``kv``, ``kv_1``, ... when its buffers' page sizes differ: KVCR has one
block size per pool) with a :class:`Span` per buffer on its transfer layer, its
entry's index source, translation and rows per page, and its hit policy
(:class:`HitPolicy`). A block is one page of one pool: one KVCR DRAM slot of
``block_bytes`` holding every span's page in span order (one part,
``pool:page``); the linker copies pages in and out itself, so no framework memory
is registered with KVCR. Keys carry a digest of the :class:`ModelIdentity` (checkpoint content,
config, revision, draft, KV-changing settings, weight version) and the entries'
geometry (dtypes, row shapes, page size, layers, policies, the attention shard
unless the group is rank-replicated), never pointers, page counts, worker or
data-parallel identity. kvcr is imported lazily, only where kvcr objects are built.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch

from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRConfigError
from sglang.srt.mem_cache.storage.kvcr.layout import pool_group_layout
from sglang.srt.mem_cache.storage.kvcr.layout.pool_layout import (
    SUPPORTED,
    HitPolicy,
    KVCRLayoutError,
    ModelIdentity,
    PoolLayout,
)

if TYPE_CHECKING:
    from kvcr.types import BlockKey

logger = logging.getLogger(__name__)

KEY_TAG = "kvcr-linker-v2"  # v2: a block is one slot holding every span
KEY_MEMO = 1 << 15  # keys a layout remembers (both ways) before starting over
_PAGE_HASH = re.compile(r"[0-9a-fA-F]{16}")
NO_MATCH_HASH = -1  # KeyAdapter.decode result for foreign keys; router hashes are >= 0


class PoolCapacity(NamedTuple):
    name: str
    block_size: int
    slot_count: int
    bytes: int


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    """KVCR DRAM per pool for one local rank; every pool holds ``pages`` pages."""

    pages: int
    pools: tuple[PoolCapacity, ...]
    budget_bytes: int
    unused_bytes: int


@dataclass(frozen=True, slots=True)
class PageLayout:
    """Every KVCR pool of one worker's KV pools, and the key scheme over them."""

    pools: tuple[PoolLayout, ...]
    page_size: int
    num_layers: int
    compatibility_digest: str
    # The digest's layout half (geometry, pools, page size) as canonical JSON, so
    # with_identity() can re-key the same pools for another model identity.
    layout_payload: str = field(default="", compare=False, repr=False)
    # Derived from ``pools`` once (the hot paths ask per request).
    full_pools: tuple[PoolLayout, ...] = field(init=False, compare=False, repr=False)
    window_pools: tuple[PoolLayout, ...] = field(init=False, compare=False, repr=False)
    full_names: frozenset[str] = field(init=False, compare=False, repr=False)
    window_names: frozenset[str] = field(init=False, compare=False, repr=False)
    # (index source, its window pools' names) per trailing source, in pool order.
    window_groups: tuple[tuple[str, frozenset[str]], ...] = field(
        init=False, compare=False, repr=False
    )
    # The DevicePoolGroup's entries by name: SGLang's ``linker.pools``.
    entry_map: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    # The group's KV is the same on every attention rank (MLA, DSA).
    rank_replicated: bool = False
    # Bytes of one page's object in each pool (every part), and across pools.
    object_bytes: dict[str, int] = field(init=False, compare=False, repr=False)
    page_total: int = field(init=False, compare=False, repr=False)
    # Keys made lately, both ways (a request keys its pages several times):
    # deterministic values, so a race between threads only loses an entry.
    key_memo: dict[tuple[str, str], BlockKey] = field(
        init=False, compare=False, repr=False
    )
    parsed_memo: dict[bytes, tuple[str, str]] = field(
        init=False, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        full = tuple(p for p in self.pools if not p.trailing)
        window = tuple(p for p in self.pools if p.trailing)
        object.__setattr__(self, "full_pools", full)  # pools a restore needs
        object.__setattr__(self, "window_pools", window)  # trailing window only
        object.__setattr__(self, "full_names", frozenset(p.name for p in full))
        object.__setattr__(self, "window_names", frozenset(p.name for p in window))
        sources = dict.fromkeys(p.indices_from for p in window)
        groups = tuple(
            (s, frozenset(p.name for p in window if p.indices_from == s))
            for s in sources
        )
        object.__setattr__(self, "window_groups", groups)
        sizes = {p.name: p.block_bytes for p in self.pools}
        object.__setattr__(self, "object_bytes", sizes)
        object.__setattr__(self, "page_total", sum(sizes.values()))
        object.__setattr__(self, "key_memo", {})
        object.__setattr__(self, "parsed_memo", {})

    @classmethod
    def from_kv_pool(
        cls,
        kvcache: Any,
        page_size: int,
        *,
        identity: ModelIdentity,
        draft_pool: Any = None,
    ) -> PageLayout:
        """The layout of a plain MHA/MLA or FULL+SWA pool (and a ``draft`` pool):
        the group ``pool_group_layout.plain_group`` builds for it.

        Raises :class:`KVCRLayoutError` for pools it cannot describe exactly.
        """
        if draft_pool is not None and not identity.draft:
            raise KVCRLayoutError("a draft KV pool needs ModelIdentity.draft set")
        group = pool_group_layout.plain_group(kvcache, page_size, draft_pool)
        return cls.from_pool_group(group, identity=identity)

    @classmethod
    def from_pool_group(cls, group: Any, *, identity: ModelIdentity) -> PageLayout:
        """One KVCR pool per entry of SGLang's ``DevicePoolGroup`` (split by page
        size), keyed by the identity and the entries' geometry."""
        if not 0 <= identity.tp_rank < identity.tp_size:
            raise KVCRLayoutError(f"bad attention TP shard in {identity}")
        page_size = int(group.page_size)
        described = [
            pool_group_layout.describe_entry(e, page_size) for e in group.entries
        ]
        pools = [p for entry_pools, _ in described for p in entry_pools]
        if pools and pools[0].trailing:
            # A KV-indexed pool first (DeepSeek V4 lists its SWA entry first): a
            # prefix's first page is looked up in the layout's first pool. Other
            # groups keep SGLang's order (and so their digests).
            pools.sort(key=lambda p: p.policy is not HitPolicy.ALL_PAGES)
        geometry = [entry_geometry for _, entry_geometry in described]
        if not pools or pools[0].trailing:
            raise KVCRLayoutError(
                f"pool group {[p.name for p in pools]} has no KV-indexed pool "
                f"first; {SUPPORTED}"
            )
        layout_part = {
            "tag": KEY_TAG,
            "page_size": page_size,
            "sharded": not group.rank_replicated,
            "geometry": geometry,
            "pools": [[p.name, p.page_bytes, p.policy.value] for p in pools],
        }
        blob = json.dumps(layout_part, sort_keys=True, default=str)
        num_layers = max(
            int(group.num_layers), 1 + max(s.layer for p in pools for s in p.spans)
        )
        digest = _digest(identity, blob)
        layout = cls(
            tuple(pools),
            page_size,
            num_layers,
            digest,
            blob,
            dict(group.entry_map),
            bool(group.rank_replicated),
        )
        summary = [(p.name, p.policy.value, len(p.spans), p.page_bytes) for p in pools]
        logger.info(
            "KVCR page layout %s: pools=%s layers=%d", digest, summary, num_layers
        )
        return layout

    def with_identity(self, identity: ModelIdentity) -> PageLayout:
        """The same pools keyed for ``identity`` (e.g. after a weight update)."""
        digest = _digest(identity, self.layout_payload)
        return replace(self, compatibility_digest=digest)

    def pool(self, name: str) -> PoolLayout:
        for p in self.pools:
            if p.name == name:
                return p
        raise KVCRLayoutError(f"no KVCR pool {name!r} in {self.pool_names}")

    @property
    def pool_names(self) -> list[str]:
        return [p.name for p in self.pools]

    def make_key(self, page_hash: str, pool: str) -> str:
        """KVCR key of one page of one KVCR pool, tagged with this digest."""
        if not page_hash or "#" in page_hash or pool not in self.object_bytes:
            raise KVCRLayoutError(f"cannot key page {page_hash!r} of pool {pool!r}")
        return f"{page_hash}#{KEY_TAG}#{self.compatibility_digest}#{pool}"

    def parse_key(self, key: str) -> tuple[str, str, str]:
        """``(page_hash, digest, pool)``; keys of other layouts raise."""
        parts = key.split("#")
        if len(parts) != 4 or parts[1] != KEY_TAG or not parts[0]:
            raise KVCRLayoutError(f"{key!r} is not a {KEY_TAG} key")
        page_hash, _, digest, pool = parts
        if digest != self.compatibility_digest or pool not in self.object_bytes:
            raise KVCRLayoutError(
                f"key {key!r} is foreign to layout {self.compatibility_digest}"
            )
        return page_hash, digest, pool

    def block_key(self, page_hash: str, pool: str) -> BlockKey:
        key = self.key_memo.get((page_hash, pool))
        if key is None:
            key = cast("BlockKey", self.make_key(page_hash, pool).encode())
            if len(self.key_memo) >= KEY_MEMO:
                self.key_memo.clear()
                self.parsed_memo.clear()
            self.key_memo[page_hash, pool] = key
            self.parsed_memo[key] = (page_hash, pool)
        return key

    def parse_block_key(self, key: bytes) -> tuple[str, str] | None:
        """(page hash, pool) of one of this layout's keys; None for any other."""
        parsed = self.parsed_memo.get(key)
        if parsed is not None:
            return parsed
        try:
            page_hash, _, pool = self.parse_key(key.decode())
        except (ValueError, UnicodeDecodeError):
            return None
        return page_hash, pool

    def kvcr_pool_layouts(self) -> list[tuple[str, int]]:
        return [(p.name, p.block_bytes) for p in self.pools]

    def local_dram_regions(
        self, storage_tensors: Sequence[torch.Tensor]
    ) -> list[tuple[str, int, int]]:
        """``LocalDramOptions.pools`` over one CPU tensor per KVCR pool, in order."""
        if len(storage_tensors) != len(self.pools):
            raise KVCRLayoutError(
                f"need {len(self.pools)} storage tensors, got {len(storage_tensors)}"
            )
        regions = []
        for p, t in zip(self.pools, storage_tensors, strict=True):
            nbytes = t.numel() * t.element_size()
            size = p.block_bytes
            if t.device.type != "cpu" or not t.is_contiguous() or nbytes < size:
                raise KVCRLayoutError(
                    f"storage for {p.name!r} must be a contiguous CPU tensor of at "
                    f"least one {size}-byte block"
                )
            regions.append((p.name, t.data_ptr(), nbytes - nbytes % size))
        return regions


class KeyAdapter:
    """kvcr ``KeyAdapter``: layout keys <-> the router's unsigned page hash, the
    one mapping hints are matched by (``page_hash_to_u64``)."""

    def __init__(self, layout: PageLayout) -> None:
        self._layout = layout

    def encode(self, framework_key: object) -> BlockKey:
        if isinstance(framework_key, str):
            self._layout.parse_key(framework_key)
            return cast("BlockKey", framework_key.encode())
        raise KVCRLayoutError(f"cannot encode {framework_key!r} as a KVCR key")

    def decode(self, key: BlockKey) -> int:
        """Router ``block_hashes`` value of the key's page; -1 for foreign keys."""
        try:
            page_hash = self._layout.parse_key(bytes(key).decode())[0]
            return page_hash_to_u64(page_hash)
        except (TypeError, ValueError):
            return NO_MATCH_HASH


def _digest(identity: ModelIdentity, layout_payload: str) -> str:
    """16 hex digits over the model identity and the layout's canonical JSON."""
    sharded = json.loads(layout_payload)["sharded"]
    model = {
        "checkpoint": identity.checkpoint,
        "config": identity.config,
        "revision": identity.revision,
        "draft": identity.draft,
        "settings": [list(item) for item in identity.settings],
        "weights_version": identity.weights_version,
        "shard": f"tp{identity.tp_rank}/{identity.tp_size}"
        if sharded
        else "replicated",
    }
    blob = json.dumps([model, layout_payload], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def plan_capacity(
    layout: PageLayout, local_dram_bytes_per_worker: int, local_ranks: int
) -> CapacityPlan:
    """Split one rank's DRAM share so every KVCR pool holds the same page count."""
    if local_ranks < 1 or local_dram_bytes_per_worker < 0:
        raise KVCRConfigError("capacity needs local_ranks >= 1 and a byte budget >= 0")
    budget = local_dram_bytes_per_worker // local_ranks
    per_page = sum(p.block_bytes for p in layout.pools)
    pages = budget // per_page
    if pages < 1:
        raise KVCRConfigError(
            f"local_dram_bytes_per_worker={local_dram_bytes_per_worker} leaves "
            f"{budget} bytes per local rank ({local_ranks} ranks), less than one "
            f"{per_page}-byte page; set it to at least {per_page * local_ranks} "
            "in --unified-cache-external-linker-config"
        )
    pools = tuple(
        PoolCapacity(p.name, p.block_bytes, pages, pages * p.block_bytes)
        for p in layout.pools
    )
    return CapacityPlan(pages, pools, budget, budget - pages * per_page)


def page_hash_to_u64(page_hash: str) -> int:
    """The router's 64-bit event hash of an SGLang page hash string, unsigned.

    SGLang's ``hash_str_to_int64`` reads the first 16 hex digits as a *signed* int64;
    this returns the same 64 bits unsigned (``hash_str_to_int64(h) & (2**64 - 1)``).
    """
    if not isinstance(page_hash, str) or not _PAGE_HASH.match(page_hash):
        raise ValueError("page_hash must start with 16 hex digits")
    return int(page_hash[:16], 16)
