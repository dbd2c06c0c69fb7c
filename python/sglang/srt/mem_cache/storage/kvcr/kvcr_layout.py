"""Describe SGLang KV pools as KVCR multi-part blocks, and key those blocks.

Every entry of the model's ``DevicePoolGroup`` (``pool_group_layout``) becomes one
KVCR pool (``kv``, ``kv_1``, ... when its buffers' page sizes differ: KVCR has one
block size per pool) with a :class:`Span` per buffer on its transfer layer, its
entry's index source, translation and rows per page, and its hit policy
(:class:`HitPolicy`). Each span is one KVCR framework region ``pool:part`` whose
element ``i`` is page ``i``; a block is one page of one pool, one ``MemoryRef``
per span. Keys carry a digest of the :class:`ModelIdentity` (checkpoint content,
config, revision, draft, KV-changing settings, weight version) and the entries'
geometry (dtypes, row shapes, page size, layers, policies, the attention shard
unless the group is rank-replicated), never pointers, page counts, worker or
data-parallel identity. kvcr is imported lazily, only where kvcr objects are built.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch

from sglang.srt.mem_cache.storage.kvcr.errors import KVCRConfigError, KVCRLinkerError
from sglang.srt.mem_cache.storage.kvcr.router_hint import page_hash_to_u64

if TYPE_CHECKING:
    from kvcr.types import BlockKey, MemoryRef, RegionDescriptor

logger = logging.getLogger(__name__)

KEY_TAG = "kvcr-linker-v1"
NO_MATCH_HASH = -1  # KeyAdapter.decode result for foreign keys; router hashes are >= 0
SUPPORTED = (
    "the KVCR linker supports dense MHA/MLA pools (MHATokenToKVPool, "
    "MLATokenToKVPool), sliding-window SWAKVPool over them, and the direct-linker "
    "pool groups SGLang builds for DSA, DeepSeek V4 and Mamba hybrids, with NHD "
    "slot rows and no scale buffers outside the group (see 'Model families' in "
    "docs/kvcr_direct_linker.md)"
)


class KVCRLayoutError(KVCRLinkerError, ValueError):
    """A KV pool, key or storage buffer cannot be described as KVCR blocks."""


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """What makes KV bytes reusable across instances (the digest's model inputs).

    ``checkpoint`` fingerprints the weights (their content where the path is a
    local directory), ``config`` the model config they run under, ``settings``
    the server arguments that change KV bytes, and ``weights_version`` is empty
    until the weights are replaced in memory (then unique per update).
    """

    checkpoint: str
    revision: str
    draft: str
    tp_rank: int
    tp_size: int
    config: str = ""
    settings: tuple[tuple[str, str], ...] = ()
    weights_version: str = ""


@dataclass(frozen=True, slots=True)
class Span:
    """One per-layer buffer: page ``i`` is ``page_bytes`` at ``base_ptr + i*stride``."""

    label: str
    base_ptr: int
    page_stride_bytes: int
    page_bytes: int
    num_pages: int
    layer: int

    def page_addr(self, page_index: int) -> int:
        return self.base_ptr + page_index * self.page_stride_bytes


class HitPolicy(enum.Enum):
    """Which pages of a restored prefix a pool must hold (its transfers' policy)."""

    ALL_PAGES = "all_pages"  # every page (KV-indexed entries)
    TRAILING_WINDOW = "trailing_window"  # the window's last pages (SWA)
    LAST_PAGE = "last_page"  # the state at the prefix's last page (Mamba)


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """One KVCR pool: equal-sized spans of one SGLang pool, in fixed part order."""

    name: str
    source: str
    spans: tuple[Span, ...]
    mem_type: str = "DRAM"
    # The SGLang transfer whose device indices address this pool ("kv", "swa",
    # "mamba"), and which pages of a restored prefix it must hold.
    indices_from: str = "kv"
    policy: HitPolicy = HitPolicy.ALL_PAGES
    device_id: int = 0
    # Device indices per page of this pool (1 for Mamba state slots; 0: the
    # layout's page size) and buffer rows per page (0: the same).
    index_page_size: int = 0
    rows_per_page: int = 0
    tensors: tuple[torch.Tensor, ...] = field(default=(), compare=False, repr=False)
    # The entry's index translation (DevicePoolEntry.translate_indices).
    translate: Callable[[torch.Tensor], torch.Tensor] | None = field(
        default=None, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        labels = [s.label for s in self.spans]
        if (
            not self.name
            or self.name != self.name.lower()
            or ":" in self.name
            or not self.spans
            or len({s.page_bytes for s in self.spans}) != 1
            or len(set(labels)) != len(labels)
            or any(not label.startswith(f"{self.name}:") for label in labels)
            or any(s.page_stride_bytes < s.page_bytes for s in self.spans)
            or any(s.num_pages < 1 for s in self.spans)
        ):
            raise KVCRLayoutError(
                f"KVCR pool {self.name!r} needs a lowercase name and non-empty, "
                f"equal-sized, non-overlapping spans labelled '{self.name}:part'; "
                f"got {self.spans}"
            )

    @property
    def trailing(self) -> bool:
        """Whether a restore needs only some trailing pages of this pool."""
        return self.policy is not HitPolicy.ALL_PAGES

    @property
    def page_bytes(self) -> int:
        return self.spans[0].page_bytes

    def device_pages(
        self, indices: torch.Tensor, pages: int, page_size: int
    ) -> torch.Tensor:
        """Page numbers of the first ``pages`` pages of a transfer's device
        indices, translated as the entry does, where the tensor lives (no host
        sync on CUDA)."""
        step = self.index_page_size or page_size
        if self.translate is not None:
            indices = self.translate(indices)
        return (indices[: pages * step : step] // step).long()

    @property
    def num_pages(self) -> int:
        return min(s.num_pages for s in self.spans)

    @property
    def part_labels(self) -> list[str]:
        return [s.label for s in self.spans]

    def layer_part_indices(self, layer: int) -> list[int]:
        return [i for i, s in enumerate(self.spans) if s.layer == layer]

    def memory_refs(self, agent_name: str, page_index: int) -> list[MemoryRef]:
        from kvcr.types import MemoryRef

        if not 0 <= page_index < self.num_pages:
            raise KVCRLayoutError(f"page {page_index} is outside pool {self.name!r}")
        return [
            MemoryRef(
                end_point_name=agent_name, label=s.label, element_index=page_index
            )
            for s in self.spans
        ]

    def region_descriptors(self) -> list[RegionDescriptor]:
        from kvcr.types import RegionDescriptor

        return [
            RegionDescriptor(
                mem_type=self.mem_type,
                device_Id=self.device_id,
                addr=s.base_ptr,
                stride=s.page_stride_bytes
                if s.page_stride_bytes != s.page_bytes
                else 0,
                count=s.num_pages,
                size=s.page_bytes,
                label=s.label,
            )
            for s in self.spans
        ]


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
        sizes = {p.name: p.page_bytes * len(p.spans) for p in self.pools}
        object.__setattr__(self, "object_bytes", sizes)
        object.__setattr__(self, "page_total", sum(sizes.values()))

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
        from sglang.srt.mem_cache.storage.kvcr import pool_group_layout

        if draft_pool is not None and not identity.draft:
            raise KVCRLayoutError("a draft KV pool needs ModelIdentity.draft set")
        group = pool_group_layout.plain_group(kvcache, page_size, draft_pool)
        return cls.from_pool_group(group, identity=identity)

    @classmethod
    def from_pool_group(cls, group: Any, *, identity: ModelIdentity) -> PageLayout:
        """One KVCR pool per entry of SGLang's ``DevicePoolGroup`` (split by page
        size), keyed by the identity and the entries' geometry."""
        from sglang.srt.mem_cache.storage.kvcr import pool_group_layout

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
        if not page_hash or "#" in page_hash or pool not in self.pool_names:
            raise KVCRLayoutError(f"cannot key page {page_hash!r} of pool {pool!r}")
        return f"{page_hash}#{KEY_TAG}#{self.compatibility_digest}#{pool}"

    def parse_key(self, key: str) -> tuple[str, str, str]:
        """``(page_hash, digest, pool)``; keys of other layouts raise."""
        parts = key.split("#")
        if len(parts) != 4 or parts[1] != KEY_TAG or not parts[0]:
            raise KVCRLayoutError(f"{key!r} is not a {KEY_TAG} key")
        page_hash, _, digest, pool = parts
        if digest != self.compatibility_digest or pool not in self.pool_names:
            raise KVCRLayoutError(
                f"key {key!r} is foreign to layout {self.compatibility_digest}"
            )
        return page_hash, digest, pool

    def block_key(self, page_hash: str, pool: str) -> BlockKey:
        return cast("BlockKey", self.make_key(page_hash, pool).encode())

    def region_descriptors(self) -> list[RegionDescriptor]:
        return [d for p in self.pools for d in p.region_descriptors()]

    def kvcr_pool_layouts(self) -> list[tuple[str, int]]:
        return [(p.name, p.page_bytes) for p in self.pools]

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
            if t.device.type != "cpu" or not t.is_contiguous() or nbytes < p.page_bytes:
                raise KVCRLayoutError(
                    f"storage for {p.name!r} must be a contiguous CPU tensor of at "
                    f"least one {p.page_bytes}-byte block"
                )
            regions.append((p.name, t.data_ptr(), nbytes - nbytes % p.page_bytes))
        return regions


class KeyAdapter:
    """kvcr ``KeyAdapter``: layout keys <-> the router's unsigned page hash, the
    one mapping hints are matched by (``router_hint.page_hash_to_u64``)."""

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
    per_page = sum(len(p.spans) * p.page_bytes for p in layout.pools)
    pages = budget // per_page
    if pages < 1:
        raise KVCRConfigError(
            f"local_dram_bytes_per_worker={local_dram_bytes_per_worker} leaves "
            f"{budget} bytes per local rank ({local_ranks} ranks), less than one "
            f"{per_page}-byte page; set it to at least {per_page * local_ranks} "
            "in --unified-cache-external-linker-config"
        )
    slots = [(p, pages * len(p.spans)) for p in layout.pools]
    pools = tuple(
        PoolCapacity(p.name, p.page_bytes, n, n * p.page_bytes) for p, n in slots
    )
    return CapacityPlan(pages, pools, budget, budget - pages * per_page)
