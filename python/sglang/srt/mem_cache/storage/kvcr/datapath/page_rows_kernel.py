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

from sglang.srt.mem_cache.storage.kvcr.device.device_streams import device_index

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
    """One pool's parts for the one-launch copy: their base-address table and the
    per-part scratch offset tables on the device, made on the stream that
    launches (a caller launches one pool's kernel on one stream) through
    page-locked memory, so building them never blocks the host."""

    def __init__(self, parts: Sequence[torch.Tensor]) -> None:
        self.width = parts[0].shape[1]
        self.device = parts[0].device
        self.parts = len(parts)
        self._addresses = [p.data_ptr() for p in parts]
        self._bases: torch.Tensor | None = None
        self._offsets: dict[tuple[int, ...], torch.Tensor] = {}

    @staticmethod
    def usable(parts: Sequence[torch.Tensor]) -> bool:
        """Whether the kernel can move these parts: Triton, CUDA, and rows it
        can address (``rows_fit``)."""
        return HAVE_TRITON and all(p.is_cuda for p in parts) and rows_fit(parts)

    def offsets(self, rows: Sequence[int]) -> torch.Tensor:
        """The device table of each part's first word in a page's span, for
        part ``p`` at row ``rows[p]`` of the span (cached per pattern: a pool's
        rows rarely vary)."""
        key = tuple(rows)
        table = self._offsets.get(key)
        if table is None:
            table = device_index([r * self.width for r in key], self.device)
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
        if self._bases is None:
            self._bases = device_index(self._addresses, self.device)
        grid = (hi - lo, self.parts, triton.cdiv(self.width, BLOCK_WORDS))
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

    def try_launch(
        self,
        index: torch.Tensor,
        span: tuple[int, int],
        scratch: torch.Tensor,
        rows: Sequence[int],
        pitch: int,
        to_pool: bool,
    ) -> bool:
        """``launch`` with part ``p`` at row ``rows[p]`` of a page's span; False
        when the kernel is off or Triton refuses it (off for the process from
        then on: the caller copies part by part). A device fault raises."""
        if not enabled():
            return False
        try:
            self.launch(index, span, scratch, self.offsets(rows), pitch, to_pool)
        except Exception as exc:
            if device_fault(exc, self.device):
                raise  # the device failed: the copy fails
            disable("was refused")
            return False
        return True


def rows_fit(parts: Sequence[torch.Tensor]) -> bool:
    """Whether ``parts`` are rows the kernel addresses: 8-byte words, 2-D, one
    width, dense (row ``r`` at ``base + r * width`` words)."""
    if not parts:
        return False
    width = parts[0].shape[1]
    return all(
        p.dtype == torch.int64
        and p.dim() == 2
        and p.shape[1] == width
        and p.stride() == (width, 1)
        for p in parts
    )


_state = {"off": not HAVE_TRITON}  # a compile or launch refused: torch calls
_warm: set[torch.device] = set()  # devices both directions compiled for


def device_fault(exc: BaseException, device: torch.device) -> bool:
    """Whether ``exc`` is the device failing, not Triton refusing the kernel:
    torch's device errors; and a CUDA error Triton reports (its launcher prefixes
    every one, a module it cannot load as much as a sticky fault of an earlier
    kernel) when the device itself then fails a stream query."""
    if isinstance(exc, DEVICE_ERRORS):
        return True
    if not str(exc).startswith("Triton Error [CUDA]"):
        return False
    if device.type != "cuda":
        return True
    try:
        torch.cuda.current_stream(device).query()
    except Exception:
        return True
    return False


def enabled() -> bool:
    """Whether the kernel is still in use (no launch was refused)."""
    return not _state["off"]


def disable(what: str) -> None:
    """The kernel failed other than by a device error: per-part torch calls from
    now on (logged once)."""
    if not _state["off"]:
        logger.warning(
            "KVCR page-row kernel %s; using per-part copies", what, exc_info=True
        )
    _state["off"] = True


def warm(device: torch.device) -> bool:
    """Compile both directions now (startup), on tiny tensors with the argument
    kinds serving passes (whole allocations: 16-byte aligned); False (and the
    kernel off) when Triton cannot."""
    if _state["off"] or device.type != "cuda":
        return False
    if device in _warm:
        return True
    try:
        with torch.cuda.device(device):
            parts = [torch.zeros(2, 4, dtype=torch.int64, device=device)]
            kernel = RowKernel(parts)
            index = torch.zeros(2, dtype=torch.int64, device=device)
            scratch = torch.zeros(8, dtype=torch.int64, device=device)
            for to_pool in (False, True):
                kernel.launch(index, (0, 2), scratch, kernel.offsets([0]), 4, to_pool)
            torch.cuda.synchronize(device)
        _warm.add(device)
        return True
    except Exception as exc:
        if device_fault(exc, device):
            raise
        disable("did not compile")
        return False


def compiled_variants() -> int | None:
    """How many variants of the kernel are compiled in this process (None where
    this Triton keeps them elsewhere): 2 after ``warm``, and serving adds none."""
    try:
        return sum(len(entry[0]) for entry in _page_rows.device_caches.values())
    except (AttributeError, NameError, TypeError, IndexError):
        return None


def kernel_for(
    cache: dict[Any, RowKernel], parts: Sequence[torch.Tensor]
) -> RowKernel | None:
    """The cached ``RowKernel`` of ``parts`` (made on first use), or None when the
    kernel cannot move them. Keyed by every part's address, shape and strides."""
    if _state["off"]:
        return None
    key = tuple((p.data_ptr(), p.shape, p.stride(), p.dtype) for p in parts)
    kernel = cache.get(key)
    if kernel is None:
        if not RowKernel.usable(parts):
            return None
        kernel = cache[key] = RowKernel(parts)
    return kernel
