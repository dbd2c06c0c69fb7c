"""Offload results in FIFO order, and the deposits behind each.

SGLang pairs the linker's offload results with its own pending offloads by
position, on every rank, so every ``offload()`` call gets one ``OffloadRecord`` in
the FIFO at once, whatever happens to it later. A record is settled when every
deposit it was split into has completed (``STORED`` only if all succeeded). The
queue also keeps the staging slots each staged deposit holds (freed when it
completes) and the direct-path offloads waiting for their fences
(``DeferredOffload``), and ``split_deposits`` builds a ready direct offload's
deposits. While the scheduler keeps running batches, a deferred offload is also
held for ``hold_batches`` more of them (``BatchHold``), so that its deposit does
not run during the step right after the batch that wrote its pages. It never
calls KVCR: the linker submits what it builds.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from sglang.srt.mem_cache.storage.kvcr.device.device_streams import (
    device_index,
    fences_done,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import (
    Deposit,
    EntryStatus,
    OpDone,
    OpId,
)

logger = logging.getLogger(__name__)

# Direct offloads this large go to KVCR as DEPOSIT_PARTS deposits (see
# split_deposits); smaller ones as one. With one KVCR slot per page the owner
# thread's work per deposit is small (about 10 us a page), so splitting only
# pays for very large offloads: on the 2-core bench machine a 47-page (329 MB)
# offload took ~48 ms as 4 deposits and ~36 ms as one.
SPLIT_DEPOSIT_BYTES = 1 << 30
DEPOSIT_PARTS = 4
# Longest a deferred offload is held for later batches (BatchHold): a scheduler
# that stops running batches without going idle (requests held while their
# preparations fetch) must not keep the write-through waiting.
HOLD_MAX_S = 0.02


class OffloadOutcome(enum.Enum):
    PENDING = "pending"
    STORED = "stored"
    FAILED = "failed"


@dataclasses.dataclass(slots=True)
class OffloadRecord:
    """One ``offload()`` call's FIFO result, settled when all its deposits are."""

    nbytes: int = 0
    pending: int = 0  # deposits submitted and not yet completed
    ok: bool = True
    outcome: OffloadOutcome = OffloadOutcome.PENDING

    def fail(self) -> None:
        self.ok, self.outcome = False, OffloadOutcome.FAILED


@dataclasses.dataclass(frozen=True, slots=True)
class PoolPages:
    """The pages one offload stores in one KVCR pool: page hashes and their device
    page numbers (a tensor; on the host once a direct offload is deferred)."""

    pool: Any
    keys: list[str]
    pages: torch.Tensor


@dataclasses.dataclass(frozen=True, slots=True)
class DeferredOffload:
    """A direct-path offload waiting for its fences (pages written, numbers on
    the host) before its deposits are built."""

    record: OffloadRecord
    groups: list[PoolPages]
    fences: tuple[Any, ...]
    deadline: float  # past it with fences pending, the offload fails
    since: float = 0.0  # time.monotonic() at offload()
    seq: int = 0  # BatchHold's stamp: which offload this is
    ready_after: int = 0  # held until BatchHold.batches reaches it


@dataclasses.dataclass(slots=True)
class BatchHold:
    """Counts the scheduler's batch results, to hold deferred (direct-path)
    offloads.

    On a busy scheduler the first pass after a prefill's result runs the next
    step right away: a deposit submitted then (the owner thread keying and
    reserving slots, the copier's copy, all taking Python's GIL) lengthens that
    step, and with it the output gap that already holds the prefill, the worst
    inter-token latency a decoding request sees. Held until ``hold_batches``
    more batch results have come (an offload made while a batch's result is
    processed waits for that result to finish first), it runs during a later,
    ordinary step instead. No hold with ``hold_batches == 0``, without a
    scheduler reporting batches (``batches == 0``: the linker driven directly),
    for what an idle scheduler released (``release``: what was offloaded at
    least ``idle_delay_s`` ago, so that a deposit does not run while the batch's
    output is still on its way to the client), or past ``HOLD_MAX_S`` (checked
    at each pump, once a scheduler pass).
    """

    hold_batches: int = 1
    idle_delay_s: float = 0.0
    batches: int = 0  # batch results the scheduler finished processing
    in_result: int = 0  # batch results being processed now (nested: depth)
    offloads: int = 0  # offloads stamped so far
    released: int = 0  # offloads up to this stamp are not held (idle)

    def result_started(self) -> None:
        self.in_result += 1

    def result_done(self) -> None:
        self.in_result = max(0, self.in_result - 1)
        self.batches += 1

    def stamp(self) -> tuple[int, int]:
        """(seq, ready_after) for an offload deferred now."""
        self.offloads += 1
        return self.offloads, self.batches + self.hold_batches + int(self.in_result > 0)

    def release(self, seq: int) -> None:
        """The scheduler is idle: offloads up to stamp ``seq`` are not held."""
        self.released = max(self.released, seq)

    def holds(self, deferred: DeferredOffload, now: float) -> bool:
        return (
            self.hold_batches > 0
            and self.batches > 0
            and deferred.seq > self.released
            and self.batches < deferred.ready_after
            and now - deferred.since < HOLD_MAX_S
        )


class OffloadQueue:
    """The FIFO of offload results and what each deposit in flight holds."""

    def __init__(self, hold_batches: int = 1, idle_delay_s: float = 0.0) -> None:
        self._fifo: collections.deque[OffloadRecord] = collections.deque()
        self._pending: dict[OpId, OffloadRecord] = {}  # deposit op -> its offload
        self._staged: dict[OpId, tuple[int, ...]] = {}  # deposit op -> staging slots
        self._deferred: list[DeferredOffload] = []
        self.hold = BatchHold(hold_batches, idle_delay_s)

    def __len__(self) -> int:
        return len(self._fifo)

    def push(self) -> OffloadRecord:
        record = OffloadRecord()
        self._fifo.append(record)
        return record

    def withdraw(self, record: OffloadRecord) -> None:
        """``offload()`` raised after ``push``: the wrapper never queued it."""
        if self._fifo and self._fifo[-1] is record:
            self._fifo.pop()
        self.untrack(record)
        self._deferred = [d for d in self._deferred if d.record is not record]

    def untrack(self, record: OffloadRecord) -> None:
        """Submitting ``record``'s deposits raised: none of them is awaited."""
        for op_id in [k for k, v in self._pending.items() if v is record]:
            del self._pending[op_id]

    def track(
        self, op_id: OpId, record: OffloadRecord, slots: tuple[int, ...] | None = None
    ) -> None:
        """Deposit ``op_id`` belongs to ``record`` (and holds staging ``slots``)."""
        self._pending[op_id] = record
        if slots is not None:
            self._staged[op_id] = slots

    def defer(self, deferred: DeferredOffload) -> None:
        self._deferred.append(deferred)

    @property
    def has_deferred(self) -> bool:
        return bool(self._deferred)

    @property
    def deferred_count(self) -> int:
        """Direct-path offloads still waiting for their fences."""
        return len(self._deferred)

    def release_idle(self, now: float, immediate: bool = False) -> None:
        """The scheduler is idle: release the holds of what was offloaded at
        least ``idle_delay_s`` ago (later offloads stay held until a later idle
        pass, the next batch or ``HOLD_MAX_S``), or of everything when
        ``immediate``."""
        cutoff = math.inf if immediate else now - self.hold.idle_delay_s
        seq = self.hold.released
        for deferred in self._deferred:  # in stamp order, ``since`` never falls
            if deferred.since > cutoff:
                break
            seq = deferred.seq
        self.hold.release(seq)

    def take_ready(self, now: float) -> list[DeferredOffload]:
        """The leading deferred offloads no longer held (``BatchHold``) whose
        fences completed, in order; one whose fences are still pending past its
        deadline fails in place (and is taken)."""
        ready = 0
        for deferred in self._deferred:
            if self.hold.holds(deferred, now):
                break
            if not fences_done(deferred.fences):
                if now < deferred.deadline:
                    break
                logger.error("KVCR offload: pages not written in time; it fails")
                deferred.record.fail()
            ready += 1
        batch = self._deferred[:ready]
        del self._deferred[:ready]
        return batch

    def on_done(
        self, done: OpDone
    ) -> tuple[OffloadRecord | None, tuple[int, ...] | None]:
        """Apply one deposit's completion: (the record it settled, if it did;
        the staging slots it held, now free)."""
        record = self._pending.pop(done.op_id, None)
        slots = self._staged.pop(done.op_id, None)
        if record is None:
            return None, slots
        record.ok &= all(e.status is EntryStatus.SUCCESS for e in done.entries.values())
        record.pending -= 1
        if record.pending:
            return None, slots
        # Stored only if every object of it succeeded.
        record.outcome = OffloadOutcome.STORED if record.ok else OffloadOutcome.FAILED
        return record, slots

    @property
    def deposits_in_flight(self) -> bool:
        """A deposit was submitted and its result has not come back."""
        return bool(self._pending)

    @property
    def has_pending(self) -> bool:
        """A deposit is still pending (submitted, staged or waiting for its
        fences), or a result the wrapper has not taken yet says STORED (its
        stored mark is not set yet)."""
        return bool(self._pending or self._deferred) or any(
            r.outcome is not OffloadOutcome.FAILED for r in self._fifo
        )

    def completed(self) -> int:
        """How many results at the head of the FIFO are settled."""
        n = 0
        for record in self._fifo:
            if record.outcome is OffloadOutcome.PENDING:
                break
            n += 1
        return n

    def pop(self) -> bool:
        return self._fifo.popleft().outcome is OffloadOutcome.STORED

    def fail_pending(self) -> int:
        """Fail every submitted deposit's offload now (their answers will never
        come, or come too late: ignored); how many offloads failed."""
        records = {id(r): r for r in self._pending.values()}
        for record in records.values():
            record.fail()
        self._pending.clear()
        return len(records)

    def clear_deferred(self) -> None:
        self._deferred.clear()

    def reset(self) -> list[tuple[int, ...]]:
        """Forget everything (the wrapper fails its own pending offloads on a
        flush; results queued here would pair with the next offloads by
        position); returns the staging slot sets deposits still held."""
        slots = list(self._staged.values())
        self._fifo.clear()
        self._pending.clear()
        self._staged.clear()
        self._deferred.clear()
        return slots


def split_deposits(
    deferred: DeferredOffload,
    block_key: Callable[[str, str], bytes],
    pool_page_bytes: dict[str, int],
    next_op_id: Callable[[], OpId],
) -> list[Deposit]:
    """The deposits of one ready direct-path offload. Very large ones go as
    ``DEPOSIT_PARTS`` deposits (window pages with the part their page falls in),
    so the owner thread's work for each overlaps the copy of the one before."""
    record = deferred.record
    kv_group = next(g for g in deferred.groups if not g.pool.trailing)
    order = {h: i for i, h in enumerate(kv_group.keys)}
    parts = DEPOSIT_PARTS if record.nbytes >= SPLIT_DEPOSIT_BYTES else 1
    half = -(-len(order) // parts)
    chunks: dict[int, list[tuple[Any, str, int]]] = {}
    for g in deferred.groups:
        for h, p in zip(g.keys, g.pages.tolist(), strict=True):
            chunks.setdefault(order[h] // half, []).append((g.pool, h, p))
    return [
        Deposit(
            op_id=next_op_id(),
            blocks={
                block_key(h, pool.name): (pool.block_label, p) for pool, h, p in chunk
            },
            nbytes=sum(pool_page_bytes[pool.name] for pool, *_ in chunk),
        )
        for chunk in chunks.values()
    ]


def select(pages: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """``pages[keep]`` without a host sync (a leading run is a plain slice)."""
    if keep == list(range(len(keep))):
        return pages[: len(keep)]
    return pages.index_select(0, device_index(keep, pages.device))


def to_host(pages: torch.Tensor) -> torch.Tensor:
    """Start copying ``pages`` to page-locked host memory on the current stream
    (complete once an event recorded after it has); CPU tensors are returned."""
    if not pages.is_cuda:
        return pages
    host = torch.empty(pages.shape, dtype=pages.dtype, pin_memory=True)
    host.copy_(pages, non_blocking=True)
    return host
