"""Owner-thread half of the adapter: runs commands on one KVCR, turns completions
into results.

``CommandExecutor`` lives entirely on the adapter's owner thread. It executes each
queued command against the KVCR (deposit, fetch with its hint, release, discard
hint, a synchronous call), keeps the table of operations in flight with the budget
each was charged to, and on every poll hands completed operations back as
``OpDone`` values and gives their bytes back to the budget. It also chooses how
often the owner loop polls: fast while a fetch (someone waits on it), slower while
only deposits run, idle otherwise. Claims given back (``Release``) wait until
``RELEASE_DEFER_S`` after the last fetch (and after themselves) so that a
preparation the scheduler waits on is answered, its answer taken and the
restored request run, without kvcr's per-claim Python competing for the GIL
and a core; never longer than
``RELEASE_DEFER_MAX_S``. They are released when that window ends (the loop
comes back for them), earlier before any deposit, call or fetch of pages not
all resident here, and when the owner thread stops.
``CommandExecutor.fail_inflight`` answers what KVCR will never complete. The
inbox it takes commands from is ``owner_inbox``; ``KVCRAdapter`` owns the
lifecycle and the scheduler-side API around it.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_patches
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import (
    AdapterStats,
    Budget,
    ClaimId,
    ClaimsTaken,
    Deposit,
    DiscardHint,
    EntryResult,
    EntryStatus,
    Fetch,
    NoPinFramework,
    OpDone,
    OpKind,
    Release,
    Result,
    budget_of,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import (
    completion_senders,
    local_claims,
    owner_wake,
    page_fills,
    unresolved_fills,
)
from sglang.srt.mem_cache.storage.kvcr.owner.owner_inbox import Call, answer_unrun

logger = logging.getLogger(__name__)

FETCH_POLL_S = 0.0005  # owner loop period while a fetch (preparation) is in flight
DEPOSIT_POLL_S = 0.002  # only offloads in flight: background, no one waits on them
# Deposit copies in flight (their copier wakes this thread when done): this
# bounds how late a copy's deadline is noticed. Also the idle period of a KVCR
# whose progress loop cannot wake this thread (kvcr_patches.owner_wake).
IDLE_POLL_S = 0.05
# Nothing in flight: commands, and whatever kvcr's progress loop hands this
# thread (a peer's pin request, the loop's failure), wake it at once; this poll
# is only a safety net (kvcr keeps no timers of its own while idle).
QUIET_POLL_S = 1.0
# Claims per kvcr release call when releasing in the background (~0.1 ms).
RELEASE_CHUNK = 16
# A Release waits this long after the last fetch run: releasing 63 claims costs
# kvcr ~0.5 ms of Python (the owner ~1 ms of CPU beside a busy scheduler) that
# a local-hit fetch queued behind it, the scheduler taking that fetch's answer,
# and the restored request's forward and output right after would wait out.
RELEASE_DEFER_S = 0.03
# ... and at most this long after it was queued (back-to-back fetches). Slots a
# deposit or a fetch that moves pages may need are released before they run.
RELEASE_DEFER_MAX_S = 0.1


class CommandExecutor:
    """Executes commands on one KVCR from the owner thread; see the module doc."""

    __slots__ = (
        "_answered",
        "_fetched_at",
        "_kvcr",
        "_peer_checks",
        "_pins",
        "_published",
        "_releases",
        "_releases_since",
        "_results",
        "_stats",
        "_stats_lock",
        "_uncharge",
        "_wake",
        "_woken",
        "fills",
        "inflight",
        "orphan_jobs",
    )

    def __init__(
        self,
        kvcr: Any,
        pins: NoPinFramework,
        results: queue.SimpleQueue[Result],
        stats: AdapterStats,
        stats_lock: threading.Lock,
        uncharge: Callable[[Budget, int], None],
        wake: Callable[[], object] = lambda: None,
    ) -> None:
        self._kvcr = kvcr
        self._wake = wake  # wakes this thread's loop (a copy finished)
        # kvcr's progress loop wakes it too when it hands this thread work.
        self._published = owner_wake.CoalescedWake(wake)
        self._woken = owner_wake.on_published(kvcr, self._published)
        self._pins = pins
        self._results = results
        self._stats = stats
        self._stats_lock = stats_lock
        self._uncharge = uncharge
        # KVCR handle -> the deposit or fetch it runs (its id, budget and keys:
        # what a completion reports, or what a FAILED answer needs).
        self.inflight: dict[int, Deposit | Fetch] = {}
        # Fetches kvcr answered within the call (no progress-loop work follows).
        self._answered: set[int] = set()
        # Deposits being copied into their slots (page_fills), in order.
        self.fills: list[tuple[page_fills.PageFill, Deposit]] = []
        # Copies of a deposit whose begin raised (answered with the batch).
        self.orphan_jobs: list[Any] = []
        self._peer_checks = (0, 0)  # (dropped notices, unresolved fill bytes)
        # Claims whose Release is deferred (RELEASE_DEFER_S), and since when.
        self._releases: list[ClaimId] = []
        self._releases_since = 0.0
        self._fetched_at = 0.0  # when the last fetch ran

    @property
    def kvcr(self) -> Any:
        return self._kvcr

    @property
    def busy(self) -> bool:
        """Whether an operation is in flight (a fetch, or a deposit's copy) or
        claims wait to be released."""
        return bool(self.inflight or self.fills or self._releases)

    def poll_period(self) -> float:
        if self._woken and owner_wake.completed_waiting(self._kvcr):
            return 0.0  # more than poll_completed took in one batch
        period = QUIET_POLL_S
        if self.inflight:  # fetches (deposits never enter it)
            period = FETCH_POLL_S
        elif any(fill.waiting for fill, _ in self.fills):
            period = DEPOSIT_POLL_S  # a fill of another operation ends unannounced
        elif self.fills or self.orphan_jobs or not self._woken:
            period = IDLE_POLL_S
        if self._releases:  # back when the deferral ends, to release them
            period = min(period, max(0.0, self._release_due() - time.monotonic()))
        return period

    def _release_due(self) -> float:
        """When the deferred claims go back: ``RELEASE_DEFER_S`` after the
        oldest of them and after the last fetch run, at the latest
        ``RELEASE_DEFER_MAX_S`` after the oldest."""
        since = self._releases_since
        after_fetch = max(since, self._fetched_at) + RELEASE_DEFER_S
        return min(after_fetch, since + RELEASE_DEFER_MAX_S)

    def flush_releases(
        self, force: bool = True, yield_to: Callable[[], object] | None = None
    ) -> None:
        """Release the deferred claims: at once when ``force`` (the thread stops,
        or work that may need their slots is next), else only once their window
        ended (``_release_due``; an owner loop timing out sooner, e.g. polling a
        peer fetch, leaves them). With ``yield_to`` (background releases) they go
        ``RELEASE_CHUNK`` at a time, the GIL offered between chunks, and the
        rest waits for the loop's next turn once ``yield_to()`` says a command
        is queued: a fetch then runs behind one chunk, not all of them."""
        if not self._releases:
            return
        if not force and time.monotonic() < self._release_due():
            return
        released = 0
        while self._releases:
            cut = len(self._releases) if yield_to is None else RELEASE_CHUNK
            claims, self._releases = self._releases[:cut], self._releases[cut:]
            results = self._kvcr.release(claims)
            released += sum(1 for _, ok in results if ok)
            if yield_to is None or not self._releases:
                continue
            time.sleep(0)  # a scheduler thread waiting for the GIL takes it
            if yield_to():
                break
        # No progress-loop wake: kvcr resumes capacity waiters only within the
        # owner's own calls (a fill's result, a retiring release), and whatever
        # they hand its loop goes through the loop's submit, which wakes it.
        self._count("claims_released", released)

    def run_batch(self, batch: collections.deque[object], stop: object) -> bool:
        """Run ``batch`` in order, popping each command once it has run (one that
        raised stays in it, with those after it, to be answered); False at
        ``stop``."""
        while batch:
            command = batch[0]
            if command is stop:
                batch.popleft()
                return False
            if isinstance(command, (Deposit, Call)):
                # Slots a deposit reserves may need these claims gone (so may a
                # fetch's: see _execute); a call sees KVCR as every command
                # before it left it.
                self.flush_releases()
            settled = self._execute(command)
            batch.popleft()
            if not settled:
                # KVCR may have new work: its progress loop polls.
                kvcr_patches.wake()
        return True

    def _execute(self, command: object) -> bool:
        """Run ``command``; whether it left KVCR's progress loop nothing to do (a
        deposit's copy is the copier's, a release is deferred, a fetch of pages
        resident here is answered in the call)."""
        kv = self._kvcr
        if isinstance(command, Deposit):
            fill = page_fills.new_fill(kv)
            try:
                page_fills.begin(kv, fill, command.blocks, self._wake)
            except BaseException:
                # The owner thread fails and the batch answers the deposit; a
                # chunk's copy already queued must still be waited for at close.
                self.orphan_jobs.extend(fill.jobs)
                raise
            self.fills.append((fill, command))
            self._count("deposits", 1)
            return True
        if isinstance(command, Fetch):
            self._fetched_at = time.monotonic()  # deferred releases wait after it
            if command.hint is None and self._claim_resident(command):
                return True
            # Not all resident here: kvcr may reserve slots (a page to move, or
            # one its hint for this request names) the deferred claims hold.
            self.flush_releases()
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
            self.inflight[handle] = command
            self._count("fetches", 1)
            # A hint may have started peer work of its own.
            if command.hint is None and kvcr_patches.fetch_answered(kv, handle):
                self._answered.add(handle)
                return True
            return False
        if isinstance(command, Release):
            if not self._releases:
                self._releases_since = time.monotonic()
            self._releases.extend(command.claims)
            return True
        if isinstance(command, DiscardHint):
            kv.discard_hint(command.request_id)
            return False
        if isinstance(command, Call):
            if not command.future.set_running_or_notify_cancel():
                return True  # cancelled: never ran
            try:
                command.future.set_result(command.fn(kv))
            except BaseException as exc:
                command.future.set_exception(exc)
            return False
        return True  # a copy ended: poll() wakes kvcr once its fill completed

    def _claim_resident(self, command: Fetch) -> bool:
        """Answer a fetch of pages all resident here at once, claimed in one pass
        (``local_claims``) as kvcr would; False (nothing done) when not all are."""
        taken = local_claims.claim_all(
            self._kvcr, command.keys, command.expected_layout
        )
        if taken is None:
            return False
        self._count("fetches", 1)
        self._uncharge(budget_of(command), command.nbytes)
        claims = cast("list[ClaimId]", taken[0])  # kvcr's release handles
        self._results.put(ClaimsTaken(command.op_id, command.keys, claims, taken[1]))
        return True

    def settle_fills(self, timeout_s: float) -> list[Any]:
        """Closing: drop deposit copies not started, wait up to ``timeout_s`` for
        running ones, and answer every deposit FAILED; the copy jobs that still
        write (their DRAM must stay quarantined until they stop)."""
        fills, self.fills = self.fills, []
        return _settle_fills(
            self._kvcr,
            fills,
            self.orphan_jobs,
            self._results,
            self._uncharge,
            timeout_s,
        )

    def fail_inflight(self) -> None:
        """KVCR is gone: every operation it still ran completes FAILED, with its
        keys, and gives its budget back."""
        ops, self.inflight = self.inflight, {}
        self._answered.clear()
        answer_unrun(ops.values(), self._results, self._uncharge, "")

    def _count(self, field: str, n: int) -> None:
        with self._stats_lock:
            setattr(self._stats, field, getattr(self._stats, field) + n)

    def poll(self) -> None:
        self._published.polled()  # before poll_completed: a later publish wakes
        # Before KVCR's completions (fetches waiting on a fill); kvcr's progress
        # loop is woken for whatever a completed fill handed it.
        if self._poll_fills():
            kvcr_patches.wake()
        pins = self._pins.requests
        completed = self._kvcr.poll_completed()
        # A fill a deposit waits on may have just ended (and resumed kvcr's
        # capacity waiters: progress-loop work).
        refilled = bool(completed and self.fills and self._poll_fills())
        # Follow-up work (a declined pin's answer, the next step of an exchange)
        # may now sit in KVCR's progress queue: do not let it wait out an idle
        # period there. A fetch answered within its call has none; the loop is
        # woken after the results are out, not competing with their delivery.
        follow_up = refilled or self._pins.requests != pins
        for handle, entries in completed:
            if handle in self._answered:
                self._answered.discard(handle)
            else:
                follow_up = True
            op = self.inflight.get(handle)
            if op is None:
                logger.warning("KVCR completed an unknown operation %s", handle)
                continue
            # Built before it leaves ``inflight``: if this raises, the op is
            # still there to be answered FAILED.
            done = {bytes(key): _entry(result) for key, result in entries.items()}
            del self.inflight[handle]
            self._uncharge(budget_of(op), op.nbytes)
            kind = OpKind.DEPOSIT if isinstance(op, Deposit) else OpKind.FETCH
            self._results.put(OpDone(op.op_id, kind, done))
        if follow_up:
            kvcr_patches.wake()
        self._publish_peer_checks()

    def _poll_fills(self) -> int:
        """Deposits whose copies are over (and fills they wait on resolved),
        each answered and taken off ``fills`` at once; how many."""
        answered = 0
        for entry in tuple(self.fills):
            fill, command = entry
            results = page_fills.poll(self._kvcr, fill)
            if results is None:
                continue
            self.fills.remove(entry)
            answered += 1
            self._uncharge(budget_of(command), command.nbytes)
            done = {bytes(k): EntryResult(status) for k, status in results.items()}
            self._results.put(OpDone(command.op_id, OpKind.DEPOSIT, done))
        return answered

    def _publish_peer_checks(self) -> None:
        """What kvcr's peer checks counted (kvcr_patches), into the stats."""
        now = (
            completion_senders.dropped(self._kvcr),
            unresolved_fills.held(self._kvcr),
        )
        if now != self._peer_checks:
            self._peer_checks = now
            with self._stats_lock:
                self._stats.dropped_notices, self._stats.unresolved_fill_bytes = now


def _settle_fills(
    kv: Any,
    fills: list[tuple[page_fills.PageFill, Deposit]],
    orphan_jobs: list[Any],
    results: queue.SimpleQueue[Result],
    uncharge: Callable[[Budget, int], None],
    timeout_s: float,
) -> list[Any]:
    """``CommandExecutor.settle_fills`` over its deposits being copied."""
    deadline = time.monotonic() + timeout_s
    for job in orphan_jobs:
        job.cancel()  # not started: never writes
    while True:
        left = []
        for fill, command in fills:
            try:
                stopped = page_fills.abandon(kv, fill)
            except Exception:  # KVCR is going away: its slots go with it
                logger.exception("KVCR deposit could not be abandoned cleanly")
                stopped = all(job.poll() is not None for job in fill.jobs)
            if stopped:
                answer_unrun([command], results, uncharge, "")
            else:
                left.append((fill, command))
        fills = left
        orphans = [job for job in orphan_jobs if job.poll() is None]
        if (not left and not orphans) or time.monotonic() >= deadline:
            break
        time.sleep(0.005)
    # Answered now all the same: nothing waits on a closed KVCR's deposit.
    answer_unrun([c for _, c in left], results, uncharge, "")
    return [job for fill, _ in left for job in fill.jobs] + orphan_jobs


# kvcr's entry status -> ours (by name; an enum's ``name`` is slow to read).
_STATUS: dict[Any, EntryStatus] = {}


def _entry(result: Any) -> EntryResult:
    status = _STATUS.get(result.status)
    if status is None:
        status = _STATUS[result.status] = EntryStatus[result.status.name]
    slots = tuple(result.descriptors) if result.descriptors else None
    claim = None if result.release_handle is None else ClaimId(result.release_handle)
    return EntryResult(status, slots, claim)
