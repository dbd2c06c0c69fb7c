"""The typed values exchanged with the owner-thread adapter (kvcr_adapter).

Operation and claim ids (``OpId``, ``ClaimId``), commands the scheduler thread
enqueues (``Deposit``, ``Fetch``, ``Release``, ``DiscardHint``), results it
drains (``OpDone`` with one ``EntryResult`` per key, ``ClaimsTaken`` for a
fetch of pages all resident here, ``InventoryChange``), the
adapter's limits and counters, and the callbacks the KVCR factory receives. Frozen slotted dataclasses and enums only: no behaviour.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NewType

OpId = NewType("OpId", int)  # one deposit or fetch (KVCRAdapter.next_op_id)
ClaimId = NewType("ClaimId", int)  # a residency claim KVCR holds; released once


class OpKind(enum.Enum):
    DEPOSIT = "deposit"
    FETCH = "fetch"


class Budget(enum.Enum):
    """Which in-flight byte bound an operation is charged to."""

    OFFLOAD = "offload"
    PREPARE = "prepare"


class EntryStatus(enum.Enum):
    SUCCESS = "success"
    FAILED = "failed"
    DROPPED = "dropped"
    REFUSED = "refused"  # over budget, never reached KVCR


@dataclasses.dataclass(frozen=True, slots=True)
class EntryResult:
    status: EntryStatus
    slots: tuple[Any, ...] | None = None  # kvcr MemoryRefs into KVCR DRAM
    claim: ClaimId | None = None  # release handle; must be released exactly once


@dataclasses.dataclass(frozen=True, slots=True)
class OpDone:
    op_id: OpId
    kind: OpKind
    entries: Mapping[bytes, EntryResult]


@dataclasses.dataclass(frozen=True, slots=True)
class ClaimsTaken:
    """A fetch whose every key was READY here, answered in one pass: the claim
    and the DRAM slot (element index) of its ``i``-th key (``keys``, the
    fetch's own) at ``i``. Every key succeeded; each claim must be released
    exactly once. Plain lists rather than one ``EntryResult`` per key: they are
    made on the owner thread, inside the scheduler's wait for a local hit."""

    op_id: OpId
    keys: tuple[bytes, ...]
    claims: list[ClaimId]
    slots: list[int]


@dataclasses.dataclass(frozen=True, slots=True)
class InventoryChange:
    keys: tuple[bytes, ...]
    removed: bool


# What the scheduler thread drains from the adapter.
Result = OpDone | ClaimsTaken | InventoryChange


@dataclasses.dataclass(frozen=True, slots=True)
class Deposit:
    op_id: OpId
    # key -> (its block label ``pool:page``, the source page the copier reads)
    blocks: Mapping[bytes, tuple[str, int]]
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class Fetch:
    op_id: OpId
    keys: tuple[bytes, ...]
    request_id: str
    expected_layout: tuple[str, ...]
    nbytes: int
    hint: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Release:
    claims: tuple[ClaimId, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class DiscardHint:
    request_id: str


@dataclasses.dataclass(slots=True)
class AdapterStats:
    deposits: int = 0
    fetches: int = 0
    refused_offload: int = 0
    refused_prepare: int = 0
    claims_released: int = 0
    resilience_events: int = 0
    inflight_offload_bytes: int = 0
    inflight_prepare_bytes: int = 0
    peak_offload_bytes: int = 0
    peak_prepare_bytes: int = 0
    # kvcr's peer checks (kvcr_patches): completion notices dropped (not from the
    # agent their pull was sent to), and DRAM bytes failed fetches still hold.
    dropped_notices: int = 0
    unresolved_fill_bytes: int = 0


# Budget -> AdapterStats fields: (in flight, peak, refused count).
BUDGET_FIELDS = {
    Budget.OFFLOAD: ("inflight_offload_bytes", "peak_offload_bytes", "refused_offload"),
    Budget.PREPARE: ("inflight_prepare_bytes", "peak_prepare_bytes", "refused_prepare"),
}


def charge(stats: AdapterStats, limits: Any, budget: Budget, nbytes: int) -> bool:
    """Charge ``nbytes`` to ``budget`` in ``stats`` (negative: give it back);
    False, counted, when it does not fit. One operation larger than the whole
    budget still runs, alone (refusing it would refuse it forever); zero bytes (a
    claim on a resident page) always fit. The caller holds the stats lock."""
    inflight, peak, refused = BUDGET_FIELDS[budget]
    limit = (
        limits.max_inflight_offload_bytes
        if budget is Budget.OFFLOAD
        else limits.max_inflight_prepare_bytes
    )
    before = getattr(stats, inflight)
    now = before + nbytes
    if nbytes > 0 and now > limit and before > 0:
        setattr(stats, refused, getattr(stats, refused) + 1)
        return False
    setattr(stats, inflight, now)
    setattr(stats, peak, max(getattr(stats, peak), now))
    return True


def budget_of(command: Deposit | Fetch) -> Budget:
    return Budget.OFFLOAD if isinstance(command, Deposit) else Budget.PREPARE


def completed_as(command: Deposit | Fetch, status: EntryStatus) -> OpDone:
    """The result of a command that never reached KVCR: every key ``status``."""
    keys = command.blocks if isinstance(command, Deposit) else command.keys
    kind = OpKind.DEPOSIT if isinstance(command, Deposit) else OpKind.FETCH
    return OpDone(command.op_id, kind, dict.fromkeys(keys, EntryResult(status)))


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterLimits:
    max_inflight_offload_bytes: int
    max_inflight_prepare_bytes: int
    wait_timeout_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class Callbacks:
    """What the adapter hands to the KVCR factory (all run on the owner thread)."""

    request_pin: Callable[[Iterable[bytes]], int]
    poll_pin_results: Callable[[], list[tuple[int, None]]]
    release_pin: Callable[[object], bool]
    inventory_sink: Callable[[Any], None]
    on_resilience_event: Callable[[Exception], None]


class NoPinFramework:
    """Declines every source pin at once: this linker serves peers only from KVCR
    DRAM, never by pinning device pages, so a stale hint fails fast per key."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._answers: list[tuple[int, None]] = []
        self.requests = 0  # pins asked for so far (each answered at its next poll)

    def request_pin(self, keys: Iterable[bytes]) -> int:
        pin_id = next(self._ids)
        self._answers.append((pin_id, None))
        self.requests += 1
        return pin_id

    def poll_pin_results(self) -> list[tuple[int, None]]:
        answers, self._answers = self._answers, []
        return answers

    @staticmethod
    def release_pin(handle: object) -> bool:
        return True
