"""Every span of one CPU pool as rows of one tensor: a copy of many pages is one
indexed op per run of slots (the offload's gather), or per piece of one (the
restore's ``RowTeam`` scatter), not one per span.

A KVCR slot holds every span of its page in span order, and the spans of a pool
are equally wide (``PoolLayout``), so the slots of a run are consecutive rows of
that width in KVCR DRAM. The pool's span buffers are separate allocations:
``SpanRows`` views the address range from the lowest to the end of the highest as
overlapping rows, one starting every ``unit`` bytes (the largest power of two up
to 16 dividing every buffer's address, page stride and width), and only ever reads
or writes the rows of pages inside a span, whose numbers ``index`` computes. The
view owns nothing: it keeps the span tensors alive. Why: each indexed torch op on
CPU is one OpenMP parallel region, and once a second thread runs its own team
(the copier beside the scheduler's forward) every region waits for sleeping
workers to wake; one op per span (56 for a 28-layer model) cost a quarter of a
47-page copy in the bench, one op per run costs nothing visible.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Element types by width: rows move as the widest element every offset allows
# (torch's CPU index kernels move one element per step), only ever moved, never
# computed on, so any bit pattern arrives intact.
_WIDE = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16}


def element_bytes(*values: int) -> int:
    """The widest element (16, 8, 4, 2 or 1 bytes) dividing every value."""
    unit = 16
    for v in values:
        while v % unit:
            unit //= 2
    return unit


@dataclass(frozen=True, slots=True)
class SpanRows:
    """Page ``page`` of span ``j`` starts ``first[j] + page * step[j]`` bytes into
    ``flat`` (uint8 over the spans' whole address range, owning nothing)."""

    flat: torch.Tensor
    first: np.ndarray  # int64 (spans,), bytes
    step: np.ndarray  # int64 (spans,), bytes
    pages: int  # pages every span holds
    width: int  # bytes of one page of one span
    unit: int  # widest element every offset, stride and the width allow
    keep: tuple[torch.Tensor, ...]  # the span buffers the view reads and writes

    @property
    def spans(self) -> int:
        return len(self.first)

    def elem(self, store: torch.Tensor) -> int:
        """Element bytes both these rows and KVCR DRAM ``store`` allow."""
        return element_bytes(self.unit, store.data_ptr(), int(store.storage_offset()))

    def rows(self, elem: int) -> torch.Tensor:
        """Overlapping rows of ``elem``-byte elements, one starting every
        ``elem`` bytes of the range: row ``b // elem`` starts at byte ``b``."""
        flat = self.flat if elem == 1 else self.flat.view(_WIDE[elem])
        count = (self.flat.numel() - self.width) // elem + 1
        return flat.as_strided((count, self.width // elem), (1, 1))

    def index(self, pages: Sequence[int] | torch.Tensor, elem: int) -> torch.Tensor:
        """``index_array`` as a tensor (sharing its memory)."""
        return torch.from_numpy(self.index_array(pages, elem))

    def index_array(self, pages: Sequence[int] | torch.Tensor, elem: int) -> np.ndarray:
        """``(pages, spans)`` row numbers in ``rows(elem)`` of every span of each
        page, page-major (the slot order). Refuses a page outside the spans.

        Computed in numpy: small numpy operations keep the GIL, while torch calls
        (even a view) release and retake it, and a copier thread beside a
        scheduler loop that holds the GIL waits up to a switch interval each time
        (``kvcr_copier_gil.py`` times a deposit there)."""
        p = np.asarray(pages, dtype=np.int64).reshape(-1, 1)
        if p.size and (int(p.min()) < 0 or int(p.max()) >= self.pages):
            raise IndexError(f"page outside the pool's {self.pages} pages")
        return (p * self.step + self.first) // elem

    def slot_rows(self, store: torch.Tensor, elem: int) -> torch.Tensor:
        """KVCR DRAM of this pool as ``(slots * spans, width)`` rows of ``elem``-
        byte elements: slot ``s``'s span ``j`` is row ``s * spans + j``."""
        flat = store.view(-1)
        flat = flat[: flat.numel() // self.width * self.width]
        if elem > 1:
            flat = flat.view(_WIDE[elem])
        return flat.view(-1, self.width // elem)


def span_rows(parts: Sequence[torch.Tensor]) -> SpanRows:
    """The rows of ``parts`` (each a ``(pages, width)`` uint8 CPU row view of one
    span, page rows at any stride) in one view. Raises ``ValueError`` when they
    are not CPU rows of one width."""
    if not parts:
        raise ValueError("a pool without spans")
    width = int(parts[0].shape[1])
    for p in parts:
        if p.device.type != "cpu" or p.dtype != torch.uint8 or p.dim() != 2:
            raise ValueError("span rows must be 2-D uint8 CPU tensors")
        if p.shape[1] != width or (width > 1 and p.stride(1) != 1):
            raise ValueError("spans of one pool must be dense rows of one width")
        if p.shape[0] < 1:
            raise ValueError("a span without pages")
    low = min(p.data_ptr() for p in parts)
    high = max(p.data_ptr() + (p.shape[0] - 1) * p.stride(0) + width for p in parts)
    unit = element_bytes(
        width,
        low,
        *(p.data_ptr() - low for p in parts),
        *(p.stride(0) for p in parts if p.shape[0] > 1),
    )
    raw = (ctypes.c_uint8 * (high - low)).from_address(low)
    return SpanRows(
        flat=torch.frombuffer(raw, dtype=torch.uint8),
        first=np.array([p.data_ptr() - low for p in parts], dtype=np.int64),
        step=np.array([p.stride(0) for p in parts], dtype=np.int64),
        pages=min(int(p.shape[0]) for p in parts),
        width=width,
        unit=unit,
        keep=tuple(parts),
    )
