"""Deposits the linker fills itself: one KVCR slot per page, one copy from the pool.

kvcr 0.1.1's ``deposit`` checks every part of a block against framework memory
registered with NIXL and fills the slots with a NIXL WRITE from this agent to
itself, several times slower than a plain copy, with Python work per part (a
page of a 28-layer model is 56 parts). Here a block is one slot holding every
span of one page (``PoolLayout.block_label``), nothing of the pools is registered,
and a deposit goes through kvcr's own fill path instead, on the owner thread:
``_LocalDram.reserve_fill`` applies the ingest policy, allocates (evicting as
kvcr decides) and marks the slots FILLING; the attached copier writes the pages;
once it says every byte landed, or that none will be written any more,
``_apply_fill_result`` marks them READY (inventory events, fetches waiting on them
answered) or frees them, never READY with bytes that did not land. A copy not
started by kvcr's operation deadline is dropped; one already running is waited
for, so slots are never freed while written. A key already FILLING for another
operation reports that fill's outcome. Every private name used lives here;
``install`` refuses any kvcr but 0.1.1 or internals that differ.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import EntryStatus

KVCR_VERSION = "0.1.1"


class PageFillUnsupported(RuntimeError):
    """The installed kvcr is not the one whose fill internals this uses."""


@dataclasses.dataclass(frozen=True, slots=True)
class SlotRef:
    """One destination slot: KVCR pool ``pool`` at ``address`` (as kvcr has it),
    slots of ``slot_bytes``, slot number ``slot``."""

    pool: str
    address: int
    slot_bytes: int
    slot: int


class CopyJob(Protocol):
    def poll(self) -> bool | None:
        """None while bytes may still be written, else whether all landed."""

    def cancel(self) -> bool:
        """Drop the copy if it has not started (its poll then says False);
        whether it was dropped."""


class PageCopier(Protocol):
    def start(
        self,
        pairs: list[tuple[int, SlotRef]],
        deadline: float,
        on_done: Callable[[], object],
    ) -> CopyJob:
        """Queue copying source page ``row`` of ``slot.pool`` into ``slot`` for
        each ``(row, slot)``; ``on_done`` runs once no byte of it can still be
        written. Deadlines are ``time.monotonic`` (kvcr's clock)."""


@dataclasses.dataclass(slots=True, eq=False)
class PageFill:
    """One deposit on its way: the keys it reserved (and their slots), keys it
    waits on (FILLING for another operation), and results known already."""

    keys: tuple[bytes, ...]
    slots: tuple[tuple[tuple[str, int], ...], ...]
    waiting: set[bytes]
    results: dict[bytes, EntryStatus]
    deadline: float
    started: Any  # kvcr's timer reading (its transfer telemetry)
    nbytes: int
    job: CopyJob | None = None
    cancelled: bool = False


_LOCK = threading.Lock()
_installed = False
# Core of a KVCR -> its copier.
_ATTACHED: weakref.WeakKeyDictionary[Any, PageCopier] = weakref.WeakKeyDictionary()


def install() -> None:
    """Check once that kvcr's fill internals are the 0.1.1 ones; raises
    ``PageFillUnsupported`` naming what differs."""
    global _installed
    with _LOCK:
        if _installed:
            return
        from importlib.metadata import version as dist_version

        from kvcr import core, local_dram

        version = dist_version("kvcr")
        missing = [
            name
            for owner, name in (
                (local_dram._LocalDram, "reserve_fill"),
                (local_dram._LocalDram, "_apply_fill_result"),
                (local_dram, "_LocalDramState"),
                (core._KVCRCore, "_block_record"),
                (core._KVCRCore, "_prune_block_record"),
                (core._KVCRCore, "_operation_deadline"),
                (core._KVCRCore, "_record_transfer_enabled"),
            )
            if not hasattr(owner, name)
        ]
        if version != KVCR_VERSION or missing:
            raise PageFillUnsupported(
                f"kvcr {version} is installed; the linker fills KVCR slots through "
                f"kvcr {KVCR_VERSION}'s fill path (missing: {missing or 'none'}): "
                f"pip install kvcr=={KVCR_VERSION}"
            )
        _installed = True


def attach(kv: Any, copier: PageCopier) -> None:
    """Let ``copier`` fill the deposits of ``kv`` (a started ``kvcr.KVCR``)."""
    install()
    _ATTACHED[kv._core] = copier


def begin(
    kv: Any, blocks: Mapping[bytes, tuple[str, int]], wake: Callable[[], object]
) -> PageFill:
    """Owner thread: reserve the slots of ``blocks`` (key -> (its block label
    ``pool:page``, source page)) and start their copy; ``wake`` runs when the
    copy is done."""
    from kvcr.local_dram import _LocalDramState
    from kvcr.types import CacheTier

    core = kv._core
    local = core._local_dram
    copier = _ATTACHED.get(core)
    fill = PageFill((), (), set(), {}, core._operation_deadline(), core._timer(), 0)
    if local is None or copier is None:
        fill.results = dict.fromkeys(blocks, EntryStatus.FAILED)
        return fill
    by_pool: dict[str, list[bytes]] = {}
    with core._state_lock:
        for key, (label, _) in blocks.items():
            residency = core._block_record(key).local_dram
            if residency is None:
                by_pool.setdefault(label, []).append(key)
            elif residency.layout != [label]:
                fill.results[key] = EntryStatus.FAILED
            elif residency.state is _LocalDramState.READY:
                fill.results[key] = EntryStatus.SUCCESS
            elif residency.state is _LocalDramState.FILLING:
                fill.waiting.add(key)
            else:
                fill.results[key] = EntryStatus.FAILED
        reserved: dict[bytes, Any] = {}
        for label, keys in by_pool.items():
            destinations, _pending = local.reserve_fill(
                keys,
                sources=dict.fromkeys(keys, CacheTier.FW_G2),
                required_local=False,
                deadline=fill.deadline,
                layout=[label],
            )
            reserved.update(destinations)
            for key in keys:
                if key not in destinations:  # dropped, or no slot in time
                    fill.results[key] = EntryStatus.FAILED
                    core._prune_block_record(key)
        for key, status in fill.results.items():
            # A READY key this deposit's own reservations evicted is not stored.
            if status is EntryStatus.SUCCESS and not _is_ready(core, key):
                fill.results[key] = EntryStatus.FAILED
                core._prune_block_record(key)
        filled = tuple(reserved)
        slots = tuple(tuple(core._block_record(k).local_dram.slots) for k in filled)
        pools = {name: (addr, size) for name, (addr, _, size) in local._pools.items()}
    fill.keys, fill.slots = filled, slots
    pairs = []
    for key, key_slots in zip(filled, slots, strict=True):
        ((label, slot),) = key_slots
        pool = label.partition(":")[0]
        address, size = pools[pool]
        fill.nbytes += size
        pairs.append((blocks[key][1], SlotRef(pool, address, size, slot)))
    if pairs:
        fill.job = copier.start(pairs, fill.deadline, wake)
    return fill


def poll(kv: Any, fill: PageFill) -> dict[bytes, EntryStatus] | None:
    """Owner thread: every key's result once the copy is over and the fills it
    waits on resolved, else None. Its own slots are completed as soon as the copy
    is over (READY when every byte landed). Past the deadline a copy not started
    is dropped (failed); one already running is waited for and counts as it ends."""
    from kvcr.local_dram import _LocalDramState

    now = time.monotonic()
    job = fill.job
    if job is not None and not fill.cancelled and now >= fill.deadline:
        fill.cancelled = job.cancel()  # True only if it never started
    landed = True if job is None else job.poll()
    core = kv._core
    with core._state_lock:
        if landed is not None and fill.keys:
            _complete(core, fill, bool(landed))
        for key in tuple(fill.waiting):
            record = core._block_record_map.get(key)
            residency = None if record is None else record.local_dram
            filling = (
                residency is not None and residency.state is _LocalDramState.FILLING
            )
            if filling and now < fill.deadline:
                continue
            fill.waiting.discard(key)
            fill.results[key] = _status(core, key)
    if landed is None or fill.waiting:
        return None
    return fill.results


def abandon(kv: Any, fill: PageFill) -> bool:
    """Owner thread, at close: drop the copy if it has not started; whether no
    byte of it can still be written (its slots are then freed)."""
    if fill.job is not None:
        fill.job.cancel()
        if fill.job.poll() is None:
            return False
    if fill.keys:
        core = kv._core
        with core._state_lock:
            _complete(core, fill, False)
    return True


def _complete(core: Any, fill: PageFill, success: bool) -> None:
    """Apply the copy's outcome through kvcr (READY or freed) and record it."""
    from kvcr.types import CacheTier

    done, fill.keys = fill.keys, ()
    core._local_dram._apply_fill_result(done, fill.slots, success, CacheTier.FW_G2)
    core._record_transfer("local_fill", fill.started, success, len(done), fill.nbytes)
    for key in done:
        fill.results[key] = _status(core, key)


def _is_ready(core: Any, key: bytes) -> bool:
    """Whether ``key`` is READY in this KVCR's DRAM now."""
    from kvcr.local_dram import _LocalDramState

    record = core._block_record_map.get(key)
    residency = None if record is None else record.local_dram
    return residency is not None and residency.state is _LocalDramState.READY


def _status(core: Any, key: bytes) -> EntryStatus:
    return EntryStatus.SUCCESS if _is_ready(core, key) else EntryStatus.FAILED
