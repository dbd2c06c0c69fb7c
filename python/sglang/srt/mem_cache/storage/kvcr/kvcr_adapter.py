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
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from sglang.srt.mem_cache.storage.kvcr import control_auth, kvcr_patches
from sglang.srt.mem_cache.storage.kvcr.errors import (
    KVCRAdapterFailed,
    KVCRTimeoutError,
    KVCRUnavailableError,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
_STOP = object()
_FETCH_POLL_S = 0.0005  # owner loop period while a fetch (preparation) is in flight
_DEPOSIT_POLL_S = 0.002  # only offloads in flight: background, no one waits on them
# While idle it still polls (KVCR runs pin callbacks and inventory events inside
# poll_completed); commands wake it at once.
_IDLE_POLL_S = 0.05
_MAX_COMMANDS_PER_TURN = 64


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
    claim: int | None = None  # release handle; must be released exactly once


@dataclasses.dataclass(frozen=True, slots=True)
class OpDone:
    op_id: int
    kind: OpKind
    entries: Mapping[bytes, EntryResult]


@dataclasses.dataclass(frozen=True, slots=True)
class InventoryChange:
    keys: tuple[bytes, ...]
    removed: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Deposit:
    op_id: int
    blocks: Mapping[bytes, list[Any]]
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class Fetch:
    op_id: int
    keys: tuple[bytes, ...]
    request_id: str
    expected_layout: tuple[str, ...]
    nbytes: int
    hint: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Release:
    claims: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class DiscardHint:
    request_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class _Call:
    fn: Callable[[Any], Any]
    future: Future[Any]


Command = Deposit | Fetch | Release | DiscardHint | _Call


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


# Budget -> AdapterStats fields: (in flight, peak, refused count).
_BUDGET_FIELDS = {
    Budget.OFFLOAD: ("inflight_offload_bytes", "peak_offload_bytes", "refused_offload"),
    Budget.PREPARE: ("inflight_prepare_bytes", "peak_prepare_bytes", "refused_prepare"),
}


def _budget(command: Deposit | Fetch) -> Budget:
    return Budget.OFFLOAD if isinstance(command, Deposit) else Budget.PREPARE


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterLimits:
    max_inflight_offload_bytes: int
    max_inflight_prepare_bytes: int
    wait_timeout_s: float


@dataclasses.dataclass(slots=True)
class _Inflight:
    kind: OpKind
    op_id: int
    budget: Budget
    nbytes: int


class _NoPinFramework:
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


@dataclasses.dataclass(frozen=True, slots=True)
class Callbacks:
    """What the adapter hands to the KVCR factory (all run on the owner thread)."""

    request_pin: Callable[[Iterable[bytes]], int]
    poll_pin_results: Callable[[], list[tuple[int, None]]]
    release_pin: Callable[[object], bool]
    inventory_sink: Callable[[Any], None]
    on_resilience_event: Callable[[Exception], None]


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
        self._failure: BaseException | None = None
        self._stats = AdapterStats()
        self._stats_lock = threading.Lock()
        # Caller-thread state: hints whose fetch was refused, by request id.
        self._held_hints: dict[str, Mapping[str, Any]] = {}
        # Owner-thread state.
        self._kvcr: Any = None
        self._inflight: dict[int, _Inflight] = {}
        self._pins = _NoPinFramework()
        self.endpoint = ""  # peer control endpoint, set once KVCR is up
        self._clean_close = True
        self._retained: Any = None  # the KVCR an unclean close left running
        self._reclaimer: threading.Thread | None = None
        self._reclaimed = threading.Event()
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
            self._failure = KVCRTimeoutError("KVCR startup timed out")
            raise KVCRUnavailableError(
                f"KVCR did not start within {limits.wait_timeout_s:.0f} s "
                "(owner_wait_timeout_s); check host DRAM size and UCX settings"
            ) from None
        except Exception as exc:
            raise KVCRUnavailableError(
                f"KVCR failed to start: {exc}{_startup_remedy(exc)}"
            ) from exc

    # ---- scheduler-thread API -------------------------------------------------

    @property
    def owner_thread(self) -> threading.Thread:
        return self._thread

    def next_op_id(self) -> int:
        return next(self._op_ids)

    def submit(self, command: Deposit | Fetch | Release | DiscardHint) -> None:
        """Enqueue a command; results arrive through ``drain``."""
        self._raise_if_failed()
        if isinstance(command, Fetch):
            command = self._carry_hint(command)
        if isinstance(command, (Deposit, Fetch)) and not self._charge(
            _budget(command), command.nbytes
        ):
            if isinstance(command, Fetch) and command.hint is not None:
                # Not lost with its fetch: the request's next fetch carries it.
                self._held_hints[command.request_id] = command.hint
            self._complete_all(command, EntryStatus.REFUSED)
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
                self._complete_all(command, EntryStatus.REFUSED)
            return
        for command in commands:
            self._commands.put(command)

    def fail_op(self, command: Deposit | Fetch) -> None:
        """Complete a command that never reached KVCR as FAILED (e.g. a staging
        copy raised); safe from any thread."""
        self._complete_all(command, EntryStatus.FAILED)

    def _complete_all(self, command: Deposit | Fetch, status: EntryStatus) -> None:
        keys = command.blocks if isinstance(command, Deposit) else command.keys
        kind = OpKind.DEPOSIT if isinstance(command, Deposit) else OpKind.FETCH
        result = EntryResult(status)
        self._results.put(OpDone(command.op_id, kind, dict.fromkeys(keys, result)))

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
        self._commands.put(_Call(fn, future))
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
            if self.call(lambda kv: not self._inflight, timeout_s=timeout_s):
                return True
            time.sleep(0.002)
        return False

    def claims_outstanding(self) -> int:
        """Residency claims this KVCR holds (0 once closed)."""
        if self._failure is not None:
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
        if self._failure is not None and not isinstance(self._failure, _ClosedError):
            raise KVCRAdapterFailed("KVCR owner thread failed") from self._failure
        return self._clean_close

    def reclaim(self, timeout_s: float) -> bool:
        """After an unclean close: whether the retained KVCR has since proven
        quiescent (a dead peer's operation resolved, e.g. it restarted on the
        same endpoint) and closed, so the DRAM it held is idle. One thread at a
        time is the retained KVCR's only caller; waits at most ``timeout_s``."""
        kv = self._retained
        if kv is None:
            return self._clean_close
        attempt = self._reclaimer
        if attempt is None or (not attempt.is_alive() and not self._reclaimed.is_set()):
            attempt = threading.Thread(
                target=self._reclaim_main,
                args=(kv,),
                name=f"{self._thread.name}-reclaim",
                daemon=True,
            )
            self._reclaimer = attempt
            attempt.start()
        attempt.join(timeout_s)
        if not self._reclaimed.is_set():
            return False
        self._retained, self._clean_close = None, True
        for i, retained in enumerate(_RETAINED):
            if retained is kv:
                del _RETAINED[i]
                break
        return True

    def _reclaim_main(self, kv: Any) -> None:
        try:
            if kvcr_patches.core_is_quiescent(kv):
                kv.close()
                self._reclaimed.set()
        except Exception:
            logger.debug("KVCR reclaim attempt failed", exc_info=True)

    # ---- budget ------------------------------------------------------------------

    def _charge(self, budget: Budget, nbytes: int) -> bool:
        inflight, peak, refused = _BUDGET_FIELDS[budget]
        limit = (
            self._limits.max_inflight_offload_bytes
            if budget is Budget.OFFLOAD
            else self._limits.max_inflight_prepare_bytes
        )
        with self._stats_lock:
            s = self._stats
            before = getattr(s, inflight)
            now = before + nbytes
            # One operation larger than the whole budget still runs, alone:
            # refusing it would refuse it forever. Zero bytes (a claim on a
            # resident page) always fits.
            if nbytes and now > limit and before > 0:
                setattr(s, refused, getattr(s, refused) + 1)
                return False
            setattr(s, inflight, now)
            setattr(s, peak, max(getattr(s, peak), now))
            return True

    def _uncharge(self, budget: Budget, nbytes: int) -> None:
        inflight = _BUDGET_FIELDS[budget][0]
        with self._stats_lock:
            setattr(self._stats, inflight, getattr(self._stats, inflight) - nbytes)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            if isinstance(self._failure, _ClosedError):
                raise KVCRAdapterFailed("KVCR adapter is closed")
            raise KVCRAdapterFailed(
                f"KVCR owner thread failed: {self._failure!r}"
            ) from self._failure

    # ---- owner thread ---------------------------------------------------------

    def _run(self, factory: Callable[[Callbacks], Any], started: Future[None]) -> None:
        try:
            self._kvcr = factory(
                Callbacks(
                    request_pin=self._pins.request_pin,
                    poll_pin_results=self._pins.poll_pin_results,
                    release_pin=self._pins.release_pin,
                    inventory_sink=self._on_inventory,
                    on_resilience_event=self._on_resilience,
                )
            )
        except BaseException as exc:
            self._failure = exc
            started.set_exception(exc)
            return
        self.endpoint = str(getattr(factory, "endpoint", ""))
        started.set_result(None)
        try:
            self._loop()
        except BaseException as exc:
            logger.exception("KVCR owner thread failed")
            self._failure = exc
        finally:
            self._shutdown()

    def _loop(self) -> None:
        while True:
            period = self._poll_period()
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
                    self._poll()
                    return
                self._execute(command)
            self._poll()

    def _poll_period(self) -> float:
        if not self._inflight:
            return _IDLE_POLL_S
        if any(op.kind is OpKind.FETCH for op in self._inflight.values()):
            return _FETCH_POLL_S
        return _DEPOSIT_POLL_S

    def _execute(self, command: object) -> None:
        self._execute_command(command)
        kvcr_patches.wake()  # KVCR may have new work: its progress loop polls now

    def _execute_command(self, command: object) -> None:
        kv = self._kvcr
        if isinstance(command, Deposit):
            handle = kv.deposit(dict(command.blocks))
            self._inflight[handle] = _Inflight(
                OpKind.DEPOSIT, command.op_id, Budget.OFFLOAD, command.nbytes
            )
            with self._stats_lock:
                self._stats.deposits += 1
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
            self._inflight[handle] = _Inflight(
                OpKind.FETCH, command.op_id, Budget.PREPARE, command.nbytes
            )
            with self._stats_lock:
                self._stats.fetches += 1
        elif isinstance(command, Release):
            results = kv.release(list(command.claims))
            released = sum(1 for _, ok in results if ok)
            with self._stats_lock:
                self._stats.claims_released += released
        elif isinstance(command, DiscardHint):
            kv.discard_hint(command.request_id)
        elif isinstance(command, _Call):
            if command.future.set_running_or_notify_cancel():
                try:
                    command.future.set_result(command.fn(kv))
                except BaseException as exc:
                    command.future.set_exception(exc)

    def _poll(self) -> None:
        pins = self._pins.requests
        completed = self._kvcr.poll_completed()
        if completed or self._pins.requests != pins:
            # Follow-up work (a declined pin's answer, the next step of an
            # exchange) may now sit in KVCR's progress queue: do not let it wait
            # out an idle period there.
            kvcr_patches.wake()
        for handle, entries in completed:
            op = self._inflight.pop(handle, None)
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

    def _on_inventory(self, event: Any) -> None:
        self._results.put(
            InventoryChange(tuple(bytes(k) for k in event.keys), bool(event.removed))
        )

    def _on_resilience(self, exc: Exception) -> None:
        with self._stats_lock:
            self._stats.resilience_events += 1
        logger.warning("KVCR resilience event: %s", exc)

    def _shutdown(self) -> None:
        kv, self._kvcr = self._kvcr, None
        if self._failure is None:
            self._failure = _ClosedError()
        # Answer callers still waiting so nobody blocks past its own deadline.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if (
                isinstance(command, _Call)
                and command.future.set_running_or_notify_cancel()
            ):
                command.future.set_exception(KVCRAdapterFailed("KVCR adapter closed"))
        if kv is not None:
            try:
                kv.close()
            except Exception:
                # kvcr keeps backend resources alive when a peer left an operation
                # unresolved; they stay referenced until the process exits.
                _RETAINED.append(kv)
                self._retained = kv
                self._clean_close = False
                logger.exception("KVCR close was not clean; resources retained")


# One line each: what failed, and the setting that fixes it.
_REMEDY_PORT = (
    "; control_port (+ attention rank) is already in use on this host: give each "
    "worker a free range of control_port values, or set control_port to 0"
)
_REMEDY_NO_UCX = (
    "; NIXL has no usable UCX backend (its plugin is missing or failed to load): "
    "unset NIXL_PLUGIN_DIR or point it at nixl's plugins, and reinstall "
    "nixl==1.5.0 (nixl-cu12/nixl-cu13)"
)
_REMEDY_GPUDIRECT = (
    "; UCX could not register memory for RDMA (ibv_reg_mr: Bad address in the UCX "
    "log means no GPUDirect RDMA): load nvidia_peermem, or for same-node use set "
    "UCX_TLS=tcp,cuda_copy,cuda_ipc"
)
_REMEDY_UCX_START = (
    "; the NIXL UCX backend failed to start (the UCX ERROR lines say why): "
    "UCX_TLS must include tcp, and UCX_NET_DEVICES must name existing devices"
)


def _startup_remedy(exc: BaseException) -> str:
    """A one-line fix for the startup failures whose cause lies outside this package.

    NIXL reports most of them as a bare status (``NIXL_ERR_BACKEND``), so the nixl
    call that raised it (``register_memory`` or ``create_backend``, read from the
    traceback) tells a missing plugin, a failed registration and a bad UCX
    setting apart; any other failure gets no remedy.
    """
    message = str(exc)
    nixl_calls = _nixl_calls(exc)
    if "Address already in use" in message:
        return _REMEDY_PORT
    if "No plugins available for NIXL" in message or (
        "NIXL_ERR_NOT_FOUND" in message and "register_memory" in nixl_calls
    ):
        return _REMEDY_NO_UCX
    if ("ibv_reg_mr" in message and "Bad address" in message) or (
        "NIXL_ERR_BACKEND" in message and "register_memory" in nixl_calls
    ):
        return _REMEDY_GPUDIRECT
    if "NIXL_ERR_BACKEND" in message and "create_backend" in nixl_calls:
        return _REMEDY_UCX_START
    return ""


def _nixl_calls(exc: BaseException) -> set[str]:
    """Names of the nixl functions on the tracebacks of ``exc`` and its causes."""
    names: set[str] = set()
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        tb = cause.__traceback__
        while tb is not None:
            if str(tb.tb_frame.f_globals.get("__name__", "")).startswith("nixl"):
                names.add(tb.tb_frame.f_code.co_name)
            tb = tb.tb_next
        cause = cause.__cause__ or cause.__context__
    return names


class _ClosedError(Exception):
    """Marks a normally closed adapter (not a failure)."""


_RETAINED: list[Any] = []


def _entry(result: Any) -> EntryResult:
    status = EntryStatus[result.status.name]
    slots = tuple(result.descriptors) if result.descriptors else None
    return EntryResult(status, slots, result.release_handle)


def make_kvcr_factory(
    *,
    agent_name: str,
    pool_layouts: Sequence[tuple[str, int]],
    framework_regions: Sequence[Any],
    local_dram_pools: Sequence[tuple[str, int, int]],
    key_adapter: Any,
    control_bind_host: str,
    control_advertise_host: str,
    control_port: int,
    operation_timeout_ms: int,
    abandon_timeout_ms: int,
    eviction_policy: str,
    nixl_progress_thread: bool,
    progress_idle_ms: int = 0,
    inbound_guard: Any = None,
) -> Callable[[Callbacks], Any]:
    """A factory that builds the real KVCR on the owner thread; with an
    ``inbound_guard`` (``control_auth.InboundGuard``) its control channel checks
    who connects."""

    def build(callbacks: Callbacks) -> Any:
        kvcr_patches.configure(progress_idle_ms)
        from kvcr import KVCR, KVCRBindings
        from kvcr.config import KVCRBackendConfigs, KVCRConfig, LocalDramOptions
        from kvcr.control_channels import ZmqPeerControlChannel
        from kvcr.policy import FIFOPolicy, LRUPolicy

        channel_cls: Any = ZmqPeerControlChannel
        if inbound_guard is not None:
            channel_cls = functools.partial(
                control_auth.guarded_channel_class(), guard=inbound_guard
            )
        if control_port:
            control = channel_cls(
                control_bind_host, control_port, control_advertise_host
            )
        else:
            control = _channel_on_own_port(
                channel_cls, control_bind_host, control_advertise_host
            )
        build.endpoint = str(control.endpoint)  # type: ignore[attr-defined]
        policy = LRUPolicy() if eviction_policy == "lru" else FIFOPolicy()
        try:
            with kvcr_patches.progress_thread_setting(nixl_progress_thread):
                return KVCR(
                    KVCRConfig(
                        nixl_agent_name=agent_name,
                        pool_layouts=list(pool_layouts),
                        operation_timeout_ms=operation_timeout_ms,
                        abandon_timeout_ms=abandon_timeout_ms,
                        nixl_listen_port=0,
                    ),
                    KVCRBindings(
                        request_pin=callbacks.request_pin,
                        poll_pin_results=callbacks.poll_pin_results,
                        release_pin=callbacks.release_pin,
                        framework_control=control,
                        key_adapter=key_adapter,
                        inventory_sink=callbacks.inventory_sink,
                        policy=policy,
                        on_resilience_event=callbacks.on_resilience_event,
                    ),
                    KVCRBackendConfigs(
                        framework_regions=list(framework_regions),
                        local_dram=LocalDramOptions(pools=list(local_dram_pools)),
                    ),
                )
        except BaseException:
            close = getattr(control, "close", None)
            if close is not None:
                close()
            raise

    return build


def _channel_on_own_port(channel_cls: Any, bind_host: str, advertise_host: str) -> Any:
    """A control channel on a port the OS picks, bound before anyone can take it.

    Picking a free port, closing it and letting the channel bind it later races
    with every other process doing the same (KVCR startup then fails with
    "Address already in use"); the channel adopts this listener instead.
    """
    import socket

    listener = socket.create_server((bind_host, 0))
    try:
        channel = channel_cls(bind_host, int(listener.getsockname()[1]), advertise_host)
        channel.adopt_listener(listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the channel owns the descriptor now
    return channel
