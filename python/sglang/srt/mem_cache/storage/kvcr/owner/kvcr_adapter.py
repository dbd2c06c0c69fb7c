"""Owner-thread adapter: the only code that calls into a ``kvcr.KVCR`` instance.

One daemon thread constructs the KVCR, runs every call on it (deposit, fetch,
query, submit/discard hint, release, poll_completed, close) and keeps polling
completions while idle, so this rank serves peers and releases source claims even
when the scheduler is busy. The scheduler thread only enqueues frozen command
objects and drains typed results; synchronous calls (startup, query, reset, close)
wait on a future with a deadline. In-flight offload, preparation and abandoned
bytes are bounded: a command over budget completes at once as ``REFUSED`` and is
counted, never queued. A failure of the owner thread (or one kvcr raises from
``poll_completed``) marks the adapter FAILED and is never raised on the scheduler
path: every command queued or in flight is answered (deposits and fetches
FAILED, with their keys), later ones are answered at once, ``drain`` keeps
returning results; only synchronous calls and ``close`` raise
``KVCRAdapterFailed``. The linker then restarts KVCR (``restart_wanted`` also
asks for that: kvcr turned this worker's source writes off). No network waits or
collectives run on the owner thread; KVCR callbacks (pins, inventory, resilience)
arrive on it and are answered there.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from sglang.srt.mem_cache.storage.kvcr.config.errors import (
    KVCRAdapterFailed,
    KVCRTimeoutError,
    KVCRUnavailableError,
)
from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_patches
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import (
    AdapterLimits,
    AdapterStats,
    Callbacks,
    Deposit,
    DiscardHint,
    EntryStatus,
    Fetch,
    InventoryChange,
    NoPinFramework,
    OpId,
    Release,
    Result,
    completed_as,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_executor import CommandExecutor
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_factory import (
    BuiltKVCR,
    startup_remedy,
)
from sglang.srt.mem_cache.storage.kvcr.owner.owner_inbox import (
    Call,
    CommandGate,
    OwnerInbox,
    answer_unrun,
)
from sglang.srt.mem_cache.storage.kvcr.owner.quarantine import RetainedCore

logger = logging.getLogger(__name__)

T = TypeVar("T")
_STOP = object()
_WAKE = object()  # a deposit copy finished: poll now (runs as a no-op command)
_MAX_COMMANDS_PER_TURN = 64


class AdapterState(enum.Enum):
    """Lifecycle of one adapter: commands are taken only while RUNNING."""

    STARTING = "starting"
    RUNNING = "running"
    CLOSED = "closed"  # closed normally
    FAILED = "failed"  # the owner thread or startup failed (``_failure`` says why)


class KVCRAdapter:
    """Runs one KVCR on a dedicated owner thread; see the module docstring."""

    def __init__(
        self,
        factory: Callable[[Callbacks], Any],
        limits: AdapterLimits,
        *,
        name: str = "kvcr",
    ) -> None:
        self._limits = limits
        self._inbox = OwnerInbox()
        self._results: queue.SimpleQueue[Result] = queue.SimpleQueue()
        self._op_ids = itertools.count(1)
        self.state = AdapterState.STARTING
        self._state_lock = threading.Lock()  # STARTING -> RUNNING or FAILED, once
        self._failure: BaseException | None = None  # why it FAILED
        self._stats = AdapterStats()
        self._stats_lock = threading.Lock()
        self._gate = CommandGate(
            self._inbox, self._results, self._stats, self._stats_lock, limits
        )
        # Owner-thread state.
        self._executor: CommandExecutor | None = None
        self._pins = NoPinFramework()
        self.endpoint = ""  # peer control endpoint, set once KVCR is up
        self._clean_close = True
        self.retained: RetainedCore | None = None  # what an unclean close left
        # kvcr turned this worker's source writes off until a restart (owner
        # thread sets it, the linker reads it).
        self.restart_wanted = False
        started: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._run,
            args=(factory, started),
            name=f"kvcr-owner-{name}",
            daemon=True,
        )
        self._thread.start()
        try:
            started.result(timeout=limits.wait_timeout_s)
        except FutureTimeout:
            with self._state_lock:
                late = self.state is AdapterState.RUNNING
                if not late:
                    self._fail(KVCRTimeoutError("KVCR startup timed out"))
            if late:  # it came up just now: too late, stop it before raising
                self._inbox.put(_STOP)
            # Bounded: the caller frees the DRAM this KVCR registered next.
            self._thread.join(limits.wait_timeout_s)
            raise KVCRUnavailableError(
                f"KVCR did not start within {limits.wait_timeout_s:.0f} s "
                "(owner_wait_timeout_s); check host DRAM size and UCX settings"
            ) from None
        except Exception as exc:
            raise KVCRUnavailableError(
                f"KVCR failed to start: {exc}{startup_remedy(exc)}"
            ) from exc

    # ---- scheduler-thread API -------------------------------------------------

    @property
    def owner_thread(self) -> threading.Thread:
        return self._thread

    def next_op_id(self) -> OpId:
        return OpId(next(self._op_ids))

    @property
    def failed(self) -> bool:
        """The owner thread stopped on a failure: KVCR is gone."""
        return self.state is AdapterState.FAILED

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def submit(self, command: Deposit | Fetch | Release | DiscardHint) -> None:
        """Enqueue a command; results arrive through ``drain``. Once FAILED a
        deposit or fetch completes FAILED at once (so it does once closed)."""
        self._gate.submit(command)

    def submit_together(self, commands: Sequence[Deposit]) -> None:
        """Deposits charged to the offload budget as one: all enqueued, or all
        REFUSED (parts of one offload must not be half admitted); all FAILED
        once the adapter failed or closed."""
        self._gate.submit_together(commands)

    def fail_op(self, command: Deposit | Fetch) -> None:
        """Complete a command that never reached KVCR as FAILED (e.g. a staging
        copy raised); safe from any thread."""
        self._results.put(completed_as(command, EntryStatus.FAILED))

    def drain(self, wait_s: float = 0.0) -> list[Result]:
        """Every result produced since the last drain, in production order
        (also once FAILED or closed: what the shutdown answered); with
        ``wait_s``, waits that long at most for the first when there is none."""
        out: list[Result] = []
        if wait_s > 0:
            try:
                out.append(self._results.get(timeout=wait_s))
            except queue.Empty:
                return out
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def call(self, fn: Callable[[Any], T], timeout_s: float | None = None) -> T:
        """Run ``fn(kvcr)`` on the owner thread and wait for it, with a deadline;
        ``KVCRAdapterFailed`` once the owner thread stopped."""
        self._raise_if_failed()
        future: Future[Any] = Future()
        if not self._inbox.put(Call(fn, future)):
            self._raise_if_failed()
            raise KVCRAdapterFailed("KVCR adapter is closed")
        timeout = self._limits.wait_timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            self._raise_if_failed()
            raise KVCRTimeoutError(
                f"KVCR owner thread did not answer within {timeout:.1f} s"
            ) from None

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no operation is in flight; False at the deadline, True at
        once when FAILED (every operation was answered)."""
        if self.state in (AdapterState.FAILED, AdapterState.CLOSED):
            return True  # its shutdown answered every operation
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                if self.call(lambda kv: not self._owner().busy, timeout_s=left):
                    return True
            except KVCRAdapterFailed:
                return True  # failed or closed meanwhile: everything was answered
            except KVCRTimeoutError:
                return False
            time.sleep(0.002)
        return False

    def claims_outstanding(self) -> int:
        """Residency claims this KVCR holds (0 once closed or failed)."""
        if self.state is not AdapterState.RUNNING:
            return 0
        try:
            return int(self.call(kvcr_patches.public_claims))
        except KVCRAdapterFailed:  # failed or closed meanwhile: it holds none
            return 0

    def stats(self) -> AdapterStats:
        with self._stats_lock:
            return dataclasses.replace(self._stats)

    def close(self, timeout_s: float | None = None) -> bool:
        """Stop the owner thread and close the KVCR, both bounded.

        Returns False when KVCR could not prove quiescence: its DRAM may still be
        written by a transfer and must stay quarantined (never reused or freed).
        """
        timeout = self._limits.wait_timeout_s if timeout_s is None else timeout_s
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise KVCRTimeoutError(f"KVCR owner thread still alive after {timeout} s")
        if self.state is AdapterState.FAILED:
            raise KVCRAdapterFailed("KVCR owner thread failed") from self._failure
        return self._clean_close

    def reclaim(self, timeout_s: float) -> bool:
        """After an unclean close: whether the retained KVCR has since proven
        quiescent and closed, so the DRAM it held is idle (quarantine)."""
        if self._thread.is_alive():  # a stuck owner thread may still call KVCR
            return False
        if self.retained is None:
            return self._clean_close
        if not self.retained.reclaim(timeout_s):
            return False
        self.retained, self._clean_close = None, True
        return True

    def _raise_if_failed(self) -> None:
        if self.state is AdapterState.CLOSED:
            raise KVCRAdapterFailed("KVCR adapter is closed")
        if self.state is AdapterState.FAILED:
            raise KVCRAdapterFailed(
                f"KVCR owner thread failed: {self._failure!r}"
            ) from self._failure

    def _fail(self, exc: BaseException) -> None:
        self._failure, self.state = exc, AdapterState.FAILED

    # ---- owner thread ---------------------------------------------------------

    def _run(self, factory: Callable[[Callbacks], Any], started: Future[None]) -> None:
        try:
            built = factory(
                Callbacks(
                    request_pin=self._pins.request_pin,
                    poll_pin_results=self._pins.poll_pin_results,
                    release_pin=self._pins.release_pin,
                    inventory_sink=self._on_inventory,
                    on_resilience_event=self._on_resilience,
                )
            )
        except BaseException as exc:
            self._fail(exc)
            started.set_exception(exc)
            return
        kvcr = built
        if isinstance(built, BuiltKVCR):
            kvcr, self.endpoint = built.kvcr, built.endpoint
        # else a stand-in factory (tests) hands the KVCR alone
        self._executor = CommandExecutor(
            kvcr,
            self._pins,
            self._results,
            self._stats,
            self._stats_lock,
            self._gate.uncharge,
            lambda: self._inbox.put(_WAKE),
        )
        with self._state_lock:
            in_time = self.state is AdapterState.STARTING
            if in_time:
                self.state = AdapterState.RUNNING
        if not in_time:
            # Startup timed out meanwhile: nobody will use or close this KVCR.
            self._shutdown()
            return
        started.set_result(None)
        try:
            self._loop()
        except BaseException as exc:
            logger.exception("KVCR owner thread failed")
            self._fail(exc)
        finally:
            self._shutdown()

    def _owner(self) -> CommandExecutor:
        assert self._executor is not None, "only called while RUNNING"
        return self._executor

    def _loop(self) -> None:
        owner = self._owner()
        while True:
            batch = self._inbox.take(owner.poll_period(), _MAX_COMMANDS_PER_TURN)
            running = owner.run_batch(batch, _STOP)  # pops batch
            owner.poll()  # fetches answered first, then releases
            owner.flush_releases(not running, self._inbox.queued if running else None)
            if not running:
                return

    def _on_inventory(self, event: Any) -> None:
        self._results.put(
            InventoryChange(tuple(bytes(k) for k in event.keys), bool(event.removed))
        )

    def _on_resilience(self, exc: Exception) -> None:
        with self._stats_lock:
            self._stats.resilience_events += 1
        if kvcr_patches.needs_restart(exc):
            self.restart_wanted = True
            logger.error(
                "KVCR needs a restart: %s%s", exc, kvcr_patches.restart_hint(exc)
            )
        else:
            logger.warning("KVCR resilience event: %s", exc)

    def _shutdown(self) -> None:
        owner, self._executor = self._executor, None
        kv = None if owner is None else owner.kvcr
        if self.state is not AdapterState.FAILED:
            self.state = AdapterState.CLOSED
        # Nothing is left unanswered: callers waiting get an error by their own
        # deadline, deposits and fetches (queued, or run by a KVCR that is
        # going away) complete FAILED with their keys.
        why = "KVCR owner thread failed" if self.failed else "KVCR adapter closed"
        answer_unrun(self._inbox.seal(), self._results, self._gate.uncharge, why)
        jobs: list[Any] = []
        if owner is not None:
            # Deposit copies end (or are waited for, bounded: a quarter of what
            # close waits for this thread) before KVCR closes.
            jobs = owner.settle_fills(self._limits.wait_timeout_s / 4)
            owner.fail_inflight()

        def writing() -> bool:
            return any(job.poll() is None for job in jobs)

        if jobs:
            # A deposit copy still writes KVCR DRAM: quarantined until it stops.
            logger.error("KVCR closing while a deposit copy still writes its slots")
            self._clean_close = False
        if kv is not None:
            try:
                kv.close()
            except Exception:
                # kvcr keeps backend resources alive when a peer left an operation
                # unresolved; they stay referenced until the process exits.
                self.retained = RetainedCore(kv, self._thread.name, writing=writing)
                self._clean_close = False
                logger.exception("KVCR close was not clean; resources retained")
            else:
                if jobs:
                    self.retained = RetainedCore(
                        kv, self._thread.name, writing=writing, closed=True
                    )
