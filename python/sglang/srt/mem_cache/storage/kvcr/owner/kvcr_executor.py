"""Owner-thread half of the adapter: runs commands on one KVCR, turns completions
into results.

``CommandExecutor`` lives entirely on the adapter's owner thread. It executes each
queued command against the KVCR (deposit, fetch with its hint, release, discard
hint, a synchronous call), keeps the table of operations in flight with the budget
each was charged to, and on every poll hands completed operations back as
``OpDone`` values and gives their bytes back to the budget. It also chooses how
often the owner loop polls: fast while a fetch (someone waits on it), slower while
only deposits run, idle otherwise. ``KVCRAdapter`` owns the lifecycle and the
scheduler-side API around it.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_patches
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import (
    AdapterStats,
    Budget,
    ClaimId,
    Deposit,
    DiscardHint,
    EntryResult,
    EntryStatus,
    Fetch,
    InventoryChange,
    NoPinFramework,
    OpDone,
    OpId,
    OpKind,
    Release,
)

logger = logging.getLogger(__name__)

FETCH_POLL_S = 0.0005  # owner loop period while a fetch (preparation) is in flight
DEPOSIT_POLL_S = 0.002  # only offloads in flight: background, no one waits on them
# While idle it still polls (KVCR runs pin callbacks and inventory events inside
# poll_completed); commands wake it at once.
IDLE_POLL_S = 0.05


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """Run ``fn(kvcr)`` on the owner thread; the answer goes to ``future``."""

    fn: Callable[[Any], Any]
    future: Future[Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Inflight:
    kind: OpKind
    op_id: OpId
    budget: Budget
    nbytes: int


class CommandExecutor:
    """Executes commands on one KVCR from the owner thread; see the module doc."""

    __slots__ = (
        "_kvcr",
        "_pins",
        "_results",
        "_stats",
        "_stats_lock",
        "_uncharge",
        "inflight",
    )

    def __init__(
        self,
        kvcr: Any,
        pins: NoPinFramework,
        results: queue.SimpleQueue[OpDone | InventoryChange],
        stats: AdapterStats,
        stats_lock: threading.Lock,
        uncharge: Callable[[Budget, int], None],
    ) -> None:
        self._kvcr = kvcr
        self._pins = pins
        self._results = results
        self._stats = stats
        self._stats_lock = stats_lock
        self._uncharge = uncharge
        self.inflight: dict[int, Inflight] = {}

    @property
    def kvcr(self) -> Any:
        return self._kvcr

    def poll_period(self) -> float:
        if not self.inflight:
            return IDLE_POLL_S
        if any(op.kind is OpKind.FETCH for op in self.inflight.values()):
            return FETCH_POLL_S
        return DEPOSIT_POLL_S

    def execute(self, command: object) -> None:
        self._execute(command)
        kvcr_patches.wake()  # KVCR may have new work: its progress loop polls now

    def _execute(self, command: object) -> None:
        kv = self._kvcr
        if isinstance(command, Deposit):
            handle = kv.deposit(dict(command.blocks))
            self._track(handle, OpKind.DEPOSIT, command.op_id, command.nbytes)
            self._count("deposits", 1)
        elif isinstance(command, Fetch):
            if command.hint is not None:
                try:
                    kv.submit_hint(dict(command.hint), command.request_id)
                except ValueError as exc:
                    logger.debug(
                        "KVCR refused hint for %s: %s", command.request_id, exc
                    )
            handle = kv.fetch(
                list(command.keys),
                request_id=command.request_id,
                expected_layout=list(command.expected_layout),
            )
            self._track(handle, OpKind.FETCH, command.op_id, command.nbytes)
            self._count("fetches", 1)
        elif isinstance(command, Release):
            results = kv.release(list(command.claims))
            self._count("claims_released", sum(1 for _, ok in results if ok))
        elif isinstance(command, DiscardHint):
            kv.discard_hint(command.request_id)
        elif isinstance(command, Call):
            if command.future.set_running_or_notify_cancel():
                try:
                    command.future.set_result(command.fn(kv))
                except BaseException as exc:
                    command.future.set_exception(exc)

    def _track(self, handle: int, kind: OpKind, op_id: OpId, nbytes: int) -> None:
        budget = Budget.OFFLOAD if kind is OpKind.DEPOSIT else Budget.PREPARE
        self.inflight[handle] = Inflight(kind, op_id, budget, nbytes)

    def _count(self, field: str, n: int) -> None:
        with self._stats_lock:
            setattr(self._stats, field, getattr(self._stats, field) + n)

    def poll(self) -> None:
        pins = self._pins.requests
        completed = self._kvcr.poll_completed()
        if completed or self._pins.requests != pins:
            # Follow-up work (a declined pin's answer, the next step of an
            # exchange) may now sit in KVCR's progress queue: do not let it wait
            # out an idle period there.
            kvcr_patches.wake()
        for handle, entries in completed:
            op = self.inflight.pop(handle, None)
            if op is None:
                logger.warning("KVCR completed an unknown operation %s", handle)
                continue
            self._uncharge(op.budget, op.nbytes)
            self._results.put(
                OpDone(
                    op.op_id,
                    op.kind,
                    {bytes(key): _entry(result) for key, result in entries.items()},
                )
            )


def _entry(result: Any) -> EntryResult:
    status = EntryStatus[result.status.name]
    slots = tuple(result.descriptors) if result.descriptors else None
    claim = None if result.release_handle is None else ClaimId(result.release_handle)
    return EntryResult(status, slots, claim)
