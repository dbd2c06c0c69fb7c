"""The queue between the scheduler thread and the adapter's owner thread.

``OwnerInbox`` carries frozen commands to the owner thread and is sealed when
that thread stops, so every command is either run or answered: ``answer_unrun``
completes a deposit or fetch FAILED and fails a call. ``CommandGate`` is the
scheduler thread's way in: it charges deposits and fetches to their budget
(REFUSED at once when over it, counted), keeps a refused fetch's hint for that
request's next fetch, and answers commands itself once the inbox is sealed.
``Call`` runs a function on the owner thread with its answer in a future.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRAdapterFailed
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import (
    AdapterStats,
    Budget,
    Deposit,
    DiscardHint,
    EntryStatus,
    Fetch,
    Release,
    Result,
    budget_of,
    charge,
    completed_as,
)


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """Run ``fn(kvcr)`` on the owner thread; the answer goes to ``future``."""

    fn: Callable[[Any], Any]
    future: Future[Any]


class OwnerInbox:
    """Commands from the scheduler thread to the owner thread. Once ``seal`` ran
    nothing more is taken (``put`` answers False): everything put before it is
    either run by the owner thread or returned by ``seal`` to be answered."""

    __slots__ = ("_lock", "_queue", "sealed", "taken")

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.sealed = False
        # The owner thread's current batch: taken off the queue, not yet run.
        self.taken: collections.deque[object] = collections.deque()

    def put(self, *commands: object) -> bool:
        """Queue ``commands`` in order; False (none queued) once sealed."""
        with self._lock:
            if self.sealed:
                return False
            for command in commands:
                self._queue.put(command)
            return True

    def take(self, wait_s: float, limit: int) -> collections.deque[object]:
        """Owner thread: up to ``limit`` commands (waiting up to ``wait_s`` for
        the first) into ``taken``; the caller pops each once it has run."""
        try:
            self.taken.append(self._queue.get(timeout=wait_s))
        except queue.Empty:
            return self.taken
        while len(self.taken) < limit:
            try:
                self.taken.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return self.taken

    def queued(self) -> int:
        """Commands waiting for the owner thread (approximate, for drivers)."""
        return self._queue.qsize()

    def seal(self) -> list[object]:
        """Take no more; every command taken but not run, and every one queued."""
        with self._lock:
            self.sealed = True
        left = list(self.taken)
        self.taken.clear()
        while True:
            try:
                left.append(self._queue.get_nowait())
            except queue.Empty:
                return left


class CommandGate:
    """The scheduler thread's way into the inbox: charges deposits and fetches
    to their budget (over it: REFUSED at once, counted), keeps the hint of a
    refused fetch for the request's next one, and once the inbox is sealed (the
    owner thread stopped) answers every command itself."""

    __slots__ = ("_held_hints", "_inbox", "_limits", "_lock", "_results", "_stats")

    def __init__(
        self,
        inbox: OwnerInbox,
        results: queue.SimpleQueue[Result],
        stats: AdapterStats,
        stats_lock: threading.Lock,
        limits: Any,
    ) -> None:
        self._inbox = inbox
        self._results = results
        self._stats = stats
        self._lock = stats_lock
        self._limits = limits
        # Hints whose fetch was refused, by request id.
        self._held_hints: dict[str, Mapping[str, Any]] = {}

    def submit(self, command: Deposit | Fetch | Release | DiscardHint) -> None:
        if self._inbox.sealed:
            self._answer((command,), charged=False)
            return
        if isinstance(command, Fetch):
            command = self._carry_hint(command)
        if isinstance(command, (Deposit, Fetch)) and not self._charge(
            budget_of(command), command.nbytes
        ):
            if isinstance(command, Fetch) and command.hint is not None:
                # Not lost with its fetch: the request's next fetch carries it.
                self._held_hints[command.request_id] = command.hint
            self._results.put(completed_as(command, EntryStatus.REFUSED))
            return
        if isinstance(command, DiscardHint):
            self._held_hints.pop(command.request_id, None)
        if not self._inbox.put(command):  # the owner thread stopped meanwhile
            self._answer((command,), charged=True)

    def _carry_hint(self, fetch: Fetch) -> Fetch:
        """A hint held back from this request's refused fetch rides on this one."""
        held = self._held_hints.get(fetch.request_id)
        if held is None or fetch.hint is not None or not fetch.nbytes:
            return fetch
        del self._held_hints[fetch.request_id]
        return dataclasses.replace(fetch, hint=held)

    def submit_together(self, commands: Sequence[Deposit]) -> None:
        if not commands:
            return
        if self._inbox.sealed:
            self._answer(commands, charged=False)
            return
        if not self._charge(Budget.OFFLOAD, sum(c.nbytes for c in commands)):
            for command in commands:
                self._results.put(completed_as(command, EntryStatus.REFUSED))
            return
        if not self._inbox.put(*commands):
            self._answer(commands, charged=True)

    def _answer(self, commands: Sequence[object], charged: bool) -> None:
        """Answer commands the stopped owner thread will never run (``charged``:
        their bytes were charged to a budget before it stopped)."""
        answer_unrun(
            commands,
            self._results,
            self.uncharge if charged else _no_charge,
            "KVCR owner thread failed",
        )

    def _charge(self, budget: Budget, nbytes: int) -> bool:
        with self._lock:
            return charge(self._stats, self._limits, budget, nbytes)

    def uncharge(self, budget: Budget, nbytes: int) -> None:
        with self._lock:
            charge(self._stats, self._limits, budget, -nbytes)


def _no_charge(budget: Budget, nbytes: int) -> None:
    """Nothing to give back: the command was answered before it was charged."""


def answer_unrun(
    commands: Iterable[object],
    results: queue.SimpleQueue[Result],
    uncharge: Callable[[Budget, int], None],
    why: str,
) -> None:
    """Answer commands the owner thread will never run: a deposit or fetch
    completes FAILED (its budget charge given back), a call raises ``why``; a
    release or a hint discard is dropped (the KVCR they were for is gone)."""
    for command in commands:
        if isinstance(command, (Deposit, Fetch)):
            uncharge(budget_of(command), command.nbytes)
            results.put(completed_as(command, EntryStatus.FAILED))
        elif isinstance(command, Call):
            if command.future.set_running_or_notify_cancel():
                command.future.set_exception(KVCRAdapterFailed(why))
