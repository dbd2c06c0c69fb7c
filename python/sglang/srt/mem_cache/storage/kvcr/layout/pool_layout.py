"""The value types of a KVCR page layout: one pool's spans, policy and identity.

A :class:`PoolLayout` is one KVCR pool of one ``DevicePoolEntry``: a :class:`Span`
per buffer on its transfer layer (equal page sizes), the entry's index source,
translation and rows per page, and its :class:`HitPolicy`. A KVCR block is one
page of one pool, every span in one slot (one part, ``block_label``), so KVCR's
per-object work is per page, not per layer. :class:`ModelIdentity`
is what makes KV bytes reusable across instances (the digest's model inputs), and
:class:`KVCRLayoutError` the refusal of anything that cannot be described exactly.
No SGLang or kvcr imports.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRLinkerError

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
    # The SGLang transfer whose device indices address this pool ("kv", "swa",
    # "mamba"), and which pages of a restored prefix it must hold.
    indices_from: str = "kv"
    policy: HitPolicy = HitPolicy.ALL_PAGES
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

    @property
    def block_label(self) -> str:
        """The one part label of this pool's KVCR blocks: a page's every span
        sits in one slot, span ``i`` at ``i * page_bytes``."""
        return f"{self.name}:page"

    @property
    def block_bytes(self) -> int:
        """Bytes of one KVCR block (slot): every span of one page."""
        return self.page_bytes * len(self.spans)


def block_part_rows(slot: int, parts: int) -> tuple[int, ...]:
    """Rows of one span's page size (a pool's KVCR DRAM viewed as span rows)
    holding the ``parts`` spans of the block in ``slot``, in span order."""
    if parts == 1:
        return (slot,)
    return tuple(range(slot * parts, slot * parts + parts))
