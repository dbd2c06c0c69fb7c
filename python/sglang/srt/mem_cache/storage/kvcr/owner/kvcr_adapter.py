"""Owner-thread adapter: the only code that calls into a ``kvcr.KVCR`` instance.

One daemon thread constructs the KVCR, runs every call on it (deposit, fetch,
query, submit/discard hint, release, poll_completed, close) and keeps polling
completions while idle, so this rank serves peers and releases source claims even
when the scheduler is busy. The scheduler thread only enqueues frozen command
objects and drains typed results; synchronous calls (startup, query, reset, close)
wait on a future with a deadline. In-flight offload, preparation and abandoned
bytes are bounded: a command over budget completes at once as ``REFUSED`` and is
counted, never queued. A failure of the owner thread is stored and re-raised as
``KVCRAdapterFailed`` on the scheduler's next call. No network waits or
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
from collections.abc import Callable, Mapping, Sequence
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
    Budget,
    Callbacks,
    Deposit,
    DiscardHint,
    EntryStatus,
    Fetch,
    InventoryChange,
    NoPinFramework,
    OpDone,
    OpId,
    Release,
    budget_of,
    charge,
    completed_as,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_executor import Call, CommandExecutor
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_factory import (
    BuiltKVCR,
    startup_remedy,
)
from sglang.srt.mem_cache.storage.kvcr.owner.quarantine import RetainedCore

logger = logging.getLogger(__name__)

T = TypeVar("T")
_STOP = object()
_MAX_COMMANDS_PER_TURN = 64

Command = Deposit | Fetch | Release | DiscardHint | Call


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
        self._commands: queue.SimpleQueue[Command | object] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[OpDone | InventoryChange] = queue.SimpleQueue()
        self._op_ids = itertools.count(1)
        self.state = AdapterState.STARTING
        self._state_lock = threading.Lock()  # STARTING -> RUNNING or FAILED, once
        self._failure: BaseException | None = None  # why it FAILED
        self._stats = AdapterStats()
        self._stats_lock = threading.Lock()
        # Caller-thread state: hints whose fetch was refused, by request id.
        self._held_hints: dict[str, Mapping[str, Any]] = {}
        # Owner-thread state.
        self._executor: CommandExecutor | None = None
        self._pins = NoPinFramework()
        self.endpoint = ""  # peer control endpoint, set once KVCR is up
        self._clean_close = True
        self.retained: RetainedCore | None = None  # what an unclean close left
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
                self._commands.put(_STOP)
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

    def submit(self, command: Deposit | Fetch | Release | DiscardHint) -> None:
        """Enqueue a command; results arrive through ``drain``."""
        self._raise_if_failed()
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
        self._commands.put(command)

    def _carry_hint(self, fetch: Fetch) -> Fetch:
        """A hint held back from this request's refused fetch rides on this one."""
        held = self._held_hints.get(fetch.request_id)
        if held is None or fetch.hint is not None or not fetch.nbytes:
            return fetch
        del self._held_hints[fetch.request_id]
        return dataclasses.replace(fetch, hint=held)

    def submit_together(self, commands: Sequence[Deposit]) -> None:
        """Deposits charged to the offload budget as one: all enqueued, or all
        REFUSED (parts of one offload must not be half admitted)."""
        self._raise_if_failed()
        if not commands:
            return
        if not self._charge(Budget.OFFLOAD, sum(c.nbytes for c in commands)):
            for command in commands:
                self._results.put(completed_as(command, EntryStatus.REFUSED))
            return
        for command in commands:
            self._commands.put(command)

    def fail_op(self, command: Deposit | Fetch) -> None:
        """Complete a command that never reached KVCR as FAILED (e.g. a staging
        copy raised); safe from any thread."""
        self._results.put(completed_as(command, EntryStatus.FAILED))

    def drain(self) -> list[OpDone | InventoryChange]:
        """Every result produced since the last drain, in production order."""
        self._raise_if_failed()
        out: list[OpDone | InventoryChange] = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def call(self, fn: Callable[[Any], T], timeout_s: float | None = None) -> T:
        """Run ``fn(kvcr)`` on the owner thread and wait for it, with a deadline."""
        self._raise_if_failed()
        future: Future[Any] = Future()
        self._commands.put(Call(fn, future))
        timeout = self._limits.wait_timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            self._raise_if_failed()
            raise KVCRTimeoutError(
                f"KVCR owner thread did not answer within {timeout:.1f} s"
            ) from None

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no operation is in flight; False at the deadline."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.call(lambda kv: not self._owner().inflight, timeout_s=timeout_s):
                return True
            time.sleep(0.002)
        return False

    def claims_outstanding(self) -> int:
        """Residency claims this KVCR holds (0 once closed)."""
        if self.state is not AdapterState.RUNNING:
            return 0
        return int(self.call(kvcr_patches.public_claims))

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
            self._commands.put(_STOP)
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise KVCRTimeoutError(f"KVCR owner thread still alive after {timeout} s")
        if self.state is AdapterState.FAILED:
            raise KVCRAdapterFailed("KVCR owner thread failed") from self._failure
        return self._clean_close

    def reclaim(self, timeout_s: float) -> bool:
        """After an unclean close: whether the retained KVCR has since proven
        quiescent and closed, so the DRAM it held is idle (quarantine)."""
        if self.retained is None:
            return self._clean_close
        if not self.retained.reclaim(timeout_s):
            return False
        self.retained, self._clean_close = None, True
        return True

    # ---- budget ------------------------------------------------------------------

    def _charge(self, budget: Budget, nbytes: int) -> bool:
        with self._stats_lock:
            return charge(self._stats, self._limits, budget, nbytes)

    def _uncharge(self, budget: Budget, nbytes: int) -> None:
        with self._stats_lock:
            charge(self._stats, self._limits, budget, -nbytes)

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
            self._uncharge,
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
            period = owner.poll_period()
            try:
                first = self._commands.get(timeout=period)
            except queue.Empty:
                first = None
            batch = [] if first is None else [first]
            while len(batch) < _MAX_COMMANDS_PER_TURN:
                try:
                    batch.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for command in batch:
                if command is _STOP:
                    owner.poll()
                    return
                owner.execute(command)
            owner.poll()

    def _on_inventory(self, event: Any) -> None:
        self._results.put(
            InventoryChange(tuple(bytes(k) for k in event.keys), bool(event.removed))
        )

    def _on_resilience(self, exc: Exception) -> None:
        with self._stats_lock:
            self._stats.resilience_events += 1
        logger.warning("KVCR resilience event: %s", exc)

    def _shutdown(self) -> None:
        owner, self._executor = self._executor, None
        kv = None if owner is None else owner.kvcr
        if self.state is not AdapterState.FAILED:
            self.state = AdapterState.CLOSED
        # Answer callers still waiting so nobody blocks past its own deadline.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if (
                isinstance(command, Call)
                and command.future.set_running_or_notify_cancel()
            ):
                command.future.set_exception(KVCRAdapterFailed("KVCR adapter closed"))
        if kv is not None:
            try:
                kv.close()
            except Exception:
                # kvcr keeps backend resources alive when a peer left an operation
                # unresolved; they stay referenced until the process exits.
                self.retained = RetainedCore(kv, self._thread.name)
                self._clean_close = False
                logger.exception("KVCR close was not clean; resources retained")
