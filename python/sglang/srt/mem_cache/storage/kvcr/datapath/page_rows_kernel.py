"""Every part of a chunk of pages between the pool and a scratch, in one launch.

A pool page lives in one row of each of its parts (K and V of every layer: 56
buffers for Qwen3-0.6B), each a separate allocation. Moving a chunk with one torch
call per part cost the first H200 runs 12-35 us of Python and dispatch per call,
so a restore or offload was bound by the thread issuing them (the split: 8.4 ms
of launches for a 6 ms copy of 47 pages). This Triton kernel moves every row of a
chunk in one launch: the parts' base addresses come from a device table (built
once per pool), page ``i``'s row of part ``p`` sits at ``index[i]`` in the part
and at ``i * pitch + offsets[p]`` words in the scratch. Words are 8 bytes: rows,
scratch and bases must be 8-byte aligned, as ``word_rows`` already requires.
``RowKernel.usable`` says whether a set of parts qualifies; anything else (no
Triton, a CPU pool, unequal rows) keeps the per-part torch calls.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

try:  # a GPU host has Triton with torch; a CPU pool never gets here
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the host
    HAVE_TRITON = False

BLOCK_WORDS = 1024  # 8 KiB of a row per program

# Errors of the device itself (RuntimeError subclasses): never a sign that the
# kernel is refused; the copy fails as any other device copy would.
DEVICE_ERRORS: tuple[type[BaseException], ...] = tuple(
    t
    for t in (getattr(torch, "AcceleratorError", None), torch.OutOfMemoryError)
    if isinstance(t, type)
)

if HAVE_TRITON:
    # Integers are not specialized and every pointer is a whole allocation or a
    # scratch half (16-byte aligned), so one compile per direction serves every
    # chunk: ``warm`` compiles both at startup, never while serving.
    @triton.jit(do_not_specialize=["first", "pitch", "width"])
    def _page_rows(  # type: ignore[no-untyped-def]
        bases,  # int64 [parts]: each part's first byte, as an address
        index,  # int64 [...]: the pool row of each page, from ``first`` on
        first,
        scratch,  # int64 words: the chunk's scratch
        offsets,  # int64 [parts]: a part's first word in a page's scratch span
        pitch,  # words from one page's scratch span to the next
        width,  # words in a row
        TO_POOL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0).to(tl.int64)  # products of these exceed 2**31
        p = tl.program_id(1)
        words = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = words < width
        base = tl.load(bases + p).to(tl.pointer_type(tl.int64))
        row = base + tl.load(index + first + i) * width + words
        span = scratch + i * pitch + tl.load(offsets + p) + words
        if TO_POOL:
            tl.store(row, tl.load(span, mask=mask), mask=mask)
        else:
            tl.store(span, tl.load(row, mask=mask), mask=mask)


class RowKernel:
    """One pool's parts for the one-launch copy: their base table on the device
    and the per-part scratch offsets tables, cached."""

    def __init__(self, parts: Sequence[torch.Tensor]) -> None:
        self.width = parts[0].shape[1]
        device = parts[0].device
        self.device = device
        self._bases = torch.tensor(
            [p.data_ptr() for p in parts], dtype=torch.int64, device=device
        )
        self._keys = tuple(p.data_ptr() for p in parts)
        self._offsets: dict[tuple[int, ...], torch.Tensor] = {}

    @staticmethod
    def usable(parts: Sequence[torch.Tensor]) -> bool:
        """Whether the kernel can move these parts: Triton, CUDA, 8-byte words,
        rows of one width, dense."""
        if not HAVE_TRITON or not parts:
            return False
        width = parts[0].shape[1]
        return all(
            p.is_cuda
            and p.dtype == torch.int64
            and p.dim() == 2
            and p.shape[1] == width
            and p.stride() == (width, 1)
            for p in parts
        )

    def matches(self, parts: Sequence[torch.Tensor]) -> bool:
        """Whether ``parts`` are the buffers this table was built for."""
        return tuple(p.data_ptr() for p in parts) == self._keys

    def offsets(self, rows: Sequence[int]) -> torch.Tensor:
        """The device table of each part's first word in a page's span, for
        part ``p`` at row ``rows[p]`` of the span (cached: a pool's rows rarely
        vary)."""
        key = tuple(rows)
        table = self._offsets.get(key)
        if table is None:
            table = torch.tensor(
                [r * self.width for r in key], dtype=torch.int64, device=self.device
            )
            if len(self._offsets) < 64:
                self._offsets[key] = table
        return table

    def launch(
        self,
        index: torch.Tensor,
        span: tuple[int, int],
        scratch: torch.Tensor,
        offsets: torch.Tensor,
        pitch: int,
        to_pool: bool,
    ) -> None:
        """Every part's row of pages ``index[span[0]:span[1]]`` (a whole int64
        index tensor) between the pool and ``scratch`` (int64 words, starting a
        scratch half), on the current stream."""
        lo, hi = span
        if hi <= lo:
            return
        grid = (hi - lo, self._bases.numel(), triton.cdiv(self.width, BLOCK_WORDS))
        _page_rows[grid](
            self._bases,
            index,
            lo,
            scratch,
            offsets,
            pitch,
            self.width,
            TO_POOL=to_pool,
            BLOCK=BLOCK_WORDS,
        )


_state = {"off": not HAVE_TRITON}  # a compile or launch refused: torch calls
_warm: set[torch.device] = set()  # devices both directions compiled for


def disable(what: str) -> None:
    """The kernel failed other than by a device error: per-part torch calls from
    now on (logged once)."""
    if not _state["off"]:
        logger.warning(
            "KVCR page-row kernel %s; using per-part copies", what, exc_info=True
        )
    _state["off"] = True


def warm(device: torch.device) -> bool:
    """Compile both directions now (startup), on tiny tensors of the same kinds
    of arguments; False (and the kernel off) when Triton cannot."""
    if _state["off"] or device.type != "cuda":
        return False
    if device in _warm:
        return True
    try:
        parts = [torch.zeros(2, 4, dtype=torch.int64, device=device)]
        kernel = RowKernel(parts)
        index = torch.zeros(2, dtype=torch.int64, device=device)
        scratch = torch.zeros(8, dtype=torch.int64, device=device)
        for to_pool in (False, True):
            kernel.launch(index, (0, 2), scratch, kernel.offsets([0]), 4, to_pool)
        torch.cuda.synchronize(device)
        _warm.add(device)
        return True
    except DEVICE_ERRORS:
        raise
    except Exception:
        disable("did not compile")
        return False


def kernel_for(
    cache: dict[Any, RowKernel], parts: Sequence[torch.Tensor]
) -> RowKernel | None:
    """The cached ``RowKernel`` of ``parts`` (made on first use), or None when the
    kernel cannot move them."""
    if _state["off"] or not RowKernel.usable(parts):
        return None
    key = tuple(p.data_ptr() for p in parts)
    kernel = cache.get(key)
    if kernel is None:
        kernel = cache[key] = RowKernel(parts)
    return kernel
