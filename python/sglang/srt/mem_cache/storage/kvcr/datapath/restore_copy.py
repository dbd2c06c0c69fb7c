"""Restore copies: claimed KVCR DRAM slot rows into a request's device page rows.

A restore moves, for every page, each of its spans (one row per part of its one
KVCR slot) into the pool's per-layer buffers. A batch is planned once: pages are
grouped into runs whose source slots advance by one stride (KVCR hands out slots
in order, so filled DRAM gives long runs). On CPU (``CpuRestorePlan``) each run
moves as blocks of rows into the pool viewed as rows of one tensor
(``span_rows``), on 16-byte elements where offsets allow, shared out among a
``RowTeam`` whatever the destination order. On CUDA the same runs move through
``span_restore.SpanRestore``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sglang.srt.mem_cache.storage.kvcr.datapath.row_team import (
    Piece,
    cuts,
    scatter_piece,
)
from sglang.srt.mem_cache.storage.kvcr.datapath.span_rows import SpanRows


@dataclass(frozen=True, slots=True)
class Segment:
    """Pages ``[start, stop)`` of a restore whose source slot for part ``i`` is
    ``first[i] + (page - start) * stride``."""

    start: int
    stop: int
    first: tuple[int, ...]
    stride: int


def plan_segments(src_slots: Sequence[tuple[int, ...]]) -> list[Segment]:
    """Split the pages into maximal runs whose source slots advance by one
    positive stride in every part (a single page is a run of stride 1)."""
    one = _one_run(src_slots)
    if one is not None:
        return [one]
    segments: list[Segment] = []
    n, i = len(src_slots), 0
    while i < n:
        j, stride = i + 1, 0
        while j < n:
            prev, cur = src_slots[j - 1], src_slots[j]
            step = cur[0] - prev[0]
            if step <= 0 or (stride and step != stride):
                break
            if any(b - a != step for a, b in zip(prev, cur, strict=True)):
                break
            stride = step
            j += 1
        segments.append(Segment(i, j, src_slots[i], stride or 1))
        i = j
    return segments


def _one_run(src_slots: Sequence[tuple[int, ...]]) -> Segment | None:
    """The usual restore (KVCR hands out slots in order) as one segment, checked
    in one numpy pass; None when it is not one run (or the pages' part counts
    differ): the caller then splits it page by page."""
    n = len(src_slots)
    if n < 2:
        return Segment(0, n, src_slots[0], 1) if n else None
    try:
        steps = np.diff(np.asarray(src_slots, dtype=np.int64), axis=0)
    except (ValueError, OverflowError):  # ragged parts, or not slot numbers
        return None
    if steps.ndim != 2 or steps.shape[1] == 0:
        return None
    stride = int(steps[0, 0])
    if stride <= 0 or not bool((steps == stride).all()):
        return None
    return Segment(0, n, src_slots[0], stride)


def wide_rows(rows: torch.Tensor) -> torch.Tensor:
    """The same bytes as 16- or 8-byte elements when rows allow: CPU copy and index
    kernels move uint8 rows element by element, several times below memory speed,
    and 16-byte elements index-copy faster than 8-byte ones (as ``make bench``'s
    copy section showed when both were compared; current figures: "Benchmark
    figures" in docs/kvcr_direct_linker.md). The elements are only moved, never
    computed on, so every bit pattern (NaN payloads included) arrives intact."""
    for dtype in (torch.complex128, torch.int64):
        try:
            return rows.view(dtype)
        except RuntimeError:  # row size or offset not a multiple of the width
            continue
    return rows


class CpuRestorePlan:
    """One batch's CPU restore of one pool, planned once: every page's slot rows
    into its destination page rows.

    The pool's spans are viewed as rows of one tensor (``span_rows``), so a run
    of source slots moves as pieces of (pages, spans) blocks, each one numpy
    indexed assignment of every row in it, which a ``RowTeam`` shares out
    (``pieces``); without a team (SGLang pinned the scheduler thread to one core)
    each run is one torch ``index_put_`` over torch's own pinned threads
    (``copy``). A page's parts must be the adjacent rows of its one slot
    (``block_part_rows``); anything else is refused before a byte moves.
    """

    def __init__(
        self,
        dest_pages: torch.Tensor | Sequence[int],
        src_slots: Sequence[tuple[int, ...]],
        rows: SpanRows,
        store: torch.Tensor,
    ):
        spans = rows.spans
        for parts in src_slots:
            if len(parts) != spans or parts[-1] - parts[0] != spans - 1:
                raise ValueError("a restored page's parts are not one slot's rows")
        elem = rows.elem(store)
        self.dst = rows.rows(elem)
        self.src = rows.slot_rows(store, elem)
        self.index = rows.index(dest_pages, elem)  # (pages, spans)
        self.segments = plan_segments(src_slots)
        self.row_bytes = rows.width

    def copy(self) -> None:
        """The whole copy, one ``index_put_`` per segment (torch's threads)."""
        for seg in self.segments:
            values = self._values(seg)
            self.dst.index_put_((self.index[seg.start : seg.stop],), values)

    def pieces(self) -> list[Piece]:
        """The whole copy as pieces of up to ``PIECE_BYTES`` (whole rows)."""
        spans = self.index.shape[1]
        dst, index = self.dst.numpy(), self.index.numpy()
        span_cuts = cuts(spans, self.row_bytes)
        out: list[Piece] = []
        for seg in self.segments:
            # One view of the segment's source rows, sliced per piece.
            values = self._values(seg).numpy()
            at = index[seg.start : seg.stop]
            for a, b in cuts(seg.stop - seg.start, self.row_bytes * spans):
                for lo, hi in span_cuts if b - a == 1 else [(0, spans)]:
                    out.append(
                        self.piece(dst, at[a:b, lo:hi], values[a:b, lo:hi], lo, hi)
                    )
        return out

    def piece(
        self, dst: np.ndarray, index: np.ndarray, values: np.ndarray, lo: int, hi: int
    ) -> Piece:
        """The rows of spans ``[lo, hi)`` of some pages: ``dst[index] = values``."""
        return scatter_piece(dst, index, values)

    def _values(self, seg: Segment) -> torch.Tensor:
        """Source rows of every page and span of ``seg``, shaped (pages, spans,
        row)."""
        spans, width = self.index.shape[1], self.src.shape[1]
        return self.src.as_strided(
            (seg.stop - seg.start, spans, width),
            (seg.stride * width, width, 1),
            self.src.storage_offset() + seg.first[0] * width,
        )
