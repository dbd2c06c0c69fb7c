"""The copier's units of work and what it copies: jobs, their states and timeline,
the refusal error, and one pool's share of a job.

A ``CopyJob`` is one deposit's (page, slot) pairs; it moves QUEUED -> RUNNING ->
DONE under its lock, ``poll`` saying whether every byte landed once no byte of it
can still be written. ``SlotViews`` and ``PoolCopy`` are one pool's slot rows and a
job's pairs for that pool, in slot order; ``plan_runs`` splits slots into runs of
one stride. ``datapath/dram_copy.py`` runs the jobs; ``device_gather.py`` moves a
pool's share from device pages.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from sglang.srt.mem_cache.storage.kvcr.datapath.span_rows import SpanRows
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches.page_fills import SlotRef

logger = logging.getLogger(__name__)


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclasses.dataclass(slots=True, eq=False)
class CopyJob:
    """One deposit's pairs; ``poll`` is None until no byte of it can still be
    written, then whether all of them landed (``on_done`` runs then)."""

    pairs: list[tuple[int, SlotRef]]
    deadline: float
    on_done: Callable[[], object] | None = None
    state: JobState = JobState.QUEUED
    landed: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # Its timeline (time.monotonic; 0.0 until reached), read by benchmarks:
    # queued, taken by the copier, its copies queued, reported.
    created: float = dataclasses.field(default_factory=time.monotonic)
    claimed: float = 0.0
    issued: float = 0.0
    ended: float = 0.0

    def poll(self) -> bool | None:
        return self.landed if self.state is JobState.DONE else None

    def cancel(self) -> bool:
        """Drop the job if it has not started; whether it was dropped."""
        with self.lock:
            if self.state is not JobState.QUEUED:
                return False
            self.state = JobState.DONE  # never started: nothing writes its slots
        self._notify()
        return True

    def claim(self) -> bool:
        """Move to RUNNING unless cancelled or past its deadline."""
        with self.lock:
            if self.state is not JobState.QUEUED:
                return False
            now = time.monotonic()
            if now < self.deadline:
                self.state = JobState.RUNNING
                self.claimed = now
                return True
            self.state = JobState.DONE
        self._notify()
        return False

    def finish(self, landed: bool) -> None:
        with self.lock:
            self.landed = landed
            self.state = JobState.DONE
            self.ended = time.monotonic()
        self._notify()

    def _notify(self) -> None:
        if self.on_done is not None:
            try:
                self.on_done()
            except Exception:  # a closed owner inbox: it polls no more anyway
                logger.debug("KVCR copy job: done notice not delivered", exc_info=True)


class CopyRefused(RuntimeError):
    """A pair this copier cannot write (unknown page, size mismatch, DRAM moved)."""


def plan_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``[a, b)`` index ranges of ``slots`` whose values advance by one positive
    stride, with that stride (1 for a single slot)."""
    runs: list[tuple[int, int, int]] = []
    n, a = len(slots), 0
    while a < n:
        b, stride = a + 1, 0
        while b < n:
            step = slots[b] - slots[b - 1]
            if step <= 0 or (stride and step != stride):
                break
            stride = step
            b += 1
        runs.append((a, b, stride or 1))
        a = b
    return runs


@dataclasses.dataclass(frozen=True, slots=True)
class SlotViews:
    """One pool's KVCR DRAM as slot rows (``slots``, slot bytes wide) and, for a
    CPU pool, the pool's spans and the slots as rows of ``elem``-byte elements
    (``src``, ``dst``: ``span_rows``), for the DRAM ``key`` names (address, slot
    bytes, slots). A CPU pool's are built once per DRAM: every torch view call
    releases the GIL, and a copier thread beside a scheduler loop that holds it
    then waits up to a switch interval to take it back."""

    key: tuple[int, int, int]
    slots: torch.Tensor
    rows: SpanRows | None = None
    elem: int = 1
    src: torch.Tensor | None = None
    dst: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class PoolCopy:
    """One pool's share of a job: every span's page rows, the pool's slot views,
    the (page, slot) pairs in slot order, and the DRAM they write, held for the
    job (the views own nothing)."""

    parts: list[torch.Tensor]
    views: SlotViews
    pages: list[int]
    slots: list[int]
    store: torch.Tensor

    @property
    def slots_view(self) -> torch.Tensor:
        return self.views.slots
