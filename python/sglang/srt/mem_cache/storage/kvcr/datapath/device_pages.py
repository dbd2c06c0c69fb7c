"""Where a transfer's pages sit in a device pool: page numbers, coverage, row views.

``page_numbers`` and ``covers`` read a ``PoolTransfer``'s token-slot index tensor
without a host sync (shape metadata, or arithmetic where the tensor lives);
``page_rows`` views a pool buffer as one byte row per page, the shape every copy
into or out of the pool (offload, restore, replica broadcast) indexes, and
``word_rows`` views such byte rows as 8-byte words for the device kernels.
"""

from __future__ import annotations

import torch


def page_numbers(indices: torch.Tensor, pages: int, page_size: int) -> torch.Tensor:
    """The page numbers of the first ``pages`` pages of a token-slot index tensor,
    computed where the tensor lives (no host sync on CUDA)."""
    return (indices[: pages * page_size : page_size] // page_size).long()


def covers(indices: torch.Tensor | None, pages: int, page_size: int) -> bool:
    """Whether a transfer's index tensor holds every slot of ``pages`` pages
    (shape metadata only: no host sync)."""
    return indices is not None and indices.numel() >= pages * page_size


def page_rows(tensor: torch.Tensor, rows: int, page_bytes: int) -> torch.Tensor:
    """A byte view of a buffer with one row per page (``rows`` buffer rows)."""
    pages = tensor.shape[0] // rows
    flat = tensor[: pages * rows].reshape(-1).view(torch.uint8)
    return flat.view(pages, page_bytes)


def word_rows(*rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Byte rows as 8-byte words when every one of them allows it, else all as
    given: device gather and scatter kernels move one element per thread, so
    words move 8 times fewer (the first H200 run's byte gathers were a visible
    share of an offload). Only moved, never computed on: every bit arrives."""
    try:
        return tuple(r.view(torch.int64) for r in rows)
    except RuntimeError:  # a row size or offset not a multiple of 8
        return rows
