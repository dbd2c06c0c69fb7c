"""Two halves of one device scratch, handed between a writing and a reading stream.

A device copy through a scratch has two steps on different engines: a DMA between
host and scratch, and kernels between scratch and pool pages (the restore copies
into the scratch and scatters out of it; the offload gathers into it and copies
out). On one stream each chunk's kernels and DMA run one after the other, so the
copy engine idles while a chunk's 2 x layers kernels run (the first H200 run: a
restore at 0.64-0.77x a pinned copy). Here chunks alternate between the halves:
the writer stream fills half ``b`` once the reader has finished with it (an event
the reader recorded), and the reader reads it once the writer has filled it (an
event the writer recorded), so one half's DMA runs beside the other half's
kernels. With ``two_streams`` off, or on CPU, both roles run on the caller's
stream, in order, as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class ScratchRelay:
    """One device scratch as two halves between a writer and a reader stream."""

    def __init__(self, device: torch.device, nbytes: int, two_streams: bool) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.two_streams = two_streams and self.cuda
        half = _aligned(max(1, nbytes // 2))
        self.scratch = torch.empty(2 * half, dtype=torch.uint8, device=device)
        self._free: list[Any] = [None, None]  # event after a half's last read
        self._next = 0
        self._side: Any = None
        self.chunks = 0

    @property
    def half_bytes(self) -> int:
        return self.scratch.numel() // 2

    def side(self) -> Any:
        """The second stream (made on first use, on the calling side thread's
        device), or None: everything on the caller's stream."""
        if not self.two_streams:
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.device)
        return self._side

    def grow(self, nbytes: int) -> torch.Tensor | None:
        """Make each half hold ``nbytes``; the outgrown block (the caller keeps it
        alive until every stream that used it has drained), or None."""
        if nbytes <= self.half_bytes:
            return None
        old = self.scratch
        half = _aligned(nbytes)
        self.scratch = torch.empty(2 * half, dtype=torch.uint8, device=self.device)
        self._free = [None, None]
        return old

    def take(self, nbytes: int, writer: Any) -> tuple[int, torch.Tensor]:
        """The next half (index, first ``nbytes`` of it), with ``writer`` ordered
        after the last read of it. Call ``grow`` first."""
        half = self._next
        self._next ^= 1
        self.chunks += 1
        event = self._free[half]
        if writer is not None and event is not None:
            writer.wait_event(event)
        start = half * self.half_bytes
        return half, self.scratch[start : start + nbytes]

    @staticmethod
    def hand_over(writer: Any, reader: Any) -> None:
        """Order ``reader`` after everything queued on ``writer`` so far."""
        filled = torch.cuda.Event()
        filled.record(writer)
        reader.wait_event(filled)

    @contextlib.contextmanager
    def reading(self, half: int, writer: Any, reader: Any) -> Iterator[None]:
        """Launch the reads of ``half`` on ``reader`` after what ``writer`` queued
        so far; mark the half free once they are done."""
        if reader is None or writer is None or reader is writer:
            yield
            return
        self.hand_over(writer, reader)
        with torch.cuda.stream(reader):
            try:
                yield
            finally:  # also after a failed launch: what was queued still reads
                freed = torch.cuda.Event()
                freed.record(reader)
                self._free[half] = freed


ALIGN = 256  # each half starts as an allocation does: kernels see aligned pointers


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def current_stream(device: torch.device) -> Any:
    """The calling thread's current stream on ``device`` (None on CPU)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def on(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Launch on ``stream`` (None: the current stream)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def join(main: Any, side: Any) -> None:
    """Order everything queued later on ``main`` after everything on ``side``, so
    draining ``main`` drains both (no host wait)."""
    if main is not None and side is not None and side is not main:
        main.wait_stream(side)
