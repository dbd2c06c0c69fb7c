"""Deposits the linker fills itself: one KVCR slot per page, one copy from the pool.

kvcr 0.1.1's ``deposit`` checks every part of a block against framework memory
registered with NIXL and fills the slots with a NIXL WRITE from this agent to
itself, several times slower than a plain copy, with Python work per part (a
page of a 28-layer model is 56 parts). Here a block is one slot holding every
span of one page (``PoolLayout.block_label``), nothing of the pools is registered,
and a deposit goes through kvcr's own fill path instead, on the owner thread:
its slots are reserved as ``_LocalDram.reserve_fill`` would (kvcr's allocator,
evicting as kvcr decides, but one allocation for the whole deposit, and never a
page of the same deposit) and marked FILLING; the attached copier writes the pages;
once it says every byte landed, or that none will be written any more,
``_apply_fill_result`` marks them READY (inventory events, fetches waiting on them
answered) or frees them, never READY with bytes that did not land; a chunk that
landed whole with nothing waiting on its keys is marked READY by one pass that
leaves kvcr's state exactly as that would (``batched_slots``). A copy not
started by kvcr's operation deadline is dropped; one already running is waited
for, so slots are never freed while written. A key already FILLING for another
operation reports that fill's outcome. A copier that moves bytes without the
host's cores (a device's DMA) asks for chunks (``PageCopier.chunks``): the
deposit then reserves a first few pages, queues their copy, reserves the next
chunk while it runs, and so on, each chunk completing as its own copy lands (on
CPU the copy needs the cores kvcr's allocation runs on: one chunk measured
faster). Every private name
used lives here; ``install`` refuses any kvcr but 0.1.1 or internals that differ.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import EntryStatus
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import batched_slots

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
    # (first, later) pages per reservation when the copy should start while kvcr
    # still allocates (it uses no host cores); None: reserve a deposit at once.
    chunks: tuple[int, int] | None

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
class FillPart:
    """One chunk of a deposit: the keys it reserved, their slots, its copy;
    ``keys`` is emptied once kvcr was told the outcome."""

    keys: tuple[bytes, ...]
    slots: tuple[tuple[tuple[str, int], ...], ...]
    nbytes: int
    job: CopyJob | None = None


@dataclasses.dataclass(slots=True, eq=False)
class PageFill:
    """One deposit on its way: its chunks, keys it waits on (FILLING for another
    operation), and results known already."""

    parts: list[FillPart]
    waiting: set[bytes]
    results: dict[bytes, EntryStatus]
    deadline: float
    started: Any  # kvcr's timer reading (its transfer telemetry)
    cancelled: bool = False

    @property
    def jobs(self) -> list[CopyJob]:
        return [part.job for part in self.parts if part.job is not None]


def _chunks(keys: list[bytes], sizes: tuple[int, int] | None) -> list[list[bytes]]:
    """``keys`` in chunks of ``sizes`` (first, then each later one), or whole."""
    if sizes is None:
        return [keys]
    out, at, size = [], 0, max(1, sizes[0])
    while at < len(keys):
        out.append(keys[at : at + size])
        at, size = at + size, max(1, sizes[1])
    return out


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
                (local_dram._LocalDram, "_apply_fill_result"),
                (local_dram._LocalDram, "_allocate_slots"),
                (local_dram._LocalDram, "_update_capacity_pressure"),
                (local_dram._LocalDram, "_resume_capacity_waiters"),
                (local_dram._LocalDram, "_remove_evictable"),
                # local_claims takes claims as this method does
                (local_dram._LocalDram, "_acquire_claim"),
                (local_dram._LocalDram, "_retry_unscored"),
                (local_dram._LocalDram, "_free"),
                (local_dram._LocalDram, "_size_bytes"),
                (core._KVCRCore, "_block_meta"),
                (core._KVCRCore, "_on_ingest"),
                (local_dram, "_LocalDramResidency"),
                (core._KVCRCore, "_publish_inventory"),
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
    core = kv._core
    local = core._local_dram
    queue = getattr(local, "_evictable", None)
    if not (
        hasattr(core, "_g3")
        and hasattr(core._policy, "_policy")
        and batched_slots.builtin_policy(core)
        # local_claims registers claims as _new_public_claim does; victims are
        # taken from kvcr's eviction queue as its candidates() takes them
        and (
            local is None
            or (
                hasattr(local, "_next_release_handle")
                and hasattr(local, "_public_claims")
                and hasattr(queue, "_heap")
                and hasattr(queue, "_live")
            )
        )
    ):
        raise PageFillUnsupported(
            "the linker reserves KVCR slots assuming kvcr's built-in FIFO or LRU "
            "policy with no disk tier (linker config eviction_policy 'lru' or "
            f"'fifo', no G3) and kvcr {KVCR_VERSION}'s core layout (_g3, "
            f"_policy._policy, local DRAM claim handles, its eviction queue's "
            f"heap); installed kvcr: "
            f"pip install kvcr=={KVCR_VERSION}"
        )
    _ATTACHED[core] = copier


def new_fill(kv: Any) -> PageFill:
    """An empty deposit with kvcr's operation deadline (owner thread); ``begin``
    fills it. The caller keeps it before ``begin`` runs, so a chunk's copy queued
    before ``begin`` raised is still seen (and waited for) at close."""
    core = kv._core
    return PageFill([], set(), {}, core._operation_deadline(), core._timer())


def begin(
    kv: Any,
    fill: PageFill,
    blocks: Mapping[bytes, tuple[str, int]],
    wake: Callable[[], object],
) -> None:
    """Owner thread: reserve the slots of ``blocks`` (key -> (its block label
    ``pool:page``, source page)) into ``fill`` and start their copy; ``wake``
    runs when a copy is done."""
    from kvcr.local_dram import _LocalDramState

    core = kv._core
    local = core._local_dram
    copier = _ATTACHED.get(core)
    if local is None or copier is None:
        fill.results = dict.fromkeys(blocks, EntryStatus.FAILED)
        return
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
        pools = {name: (addr, size) for name, (addr, _, size) in local._pools.items()}
    keep = set(blocks)  # no reservation of this deposit evicts one of its pages
    for label, keys in by_pool.items():
        address, size = pools[label.partition(":")[0]]
        for chunk in _chunks(keys, copier.chunks):
            with core._state_lock:
                destinations = batched_slots.reserve(
                    core, chunk, label, fill.deadline, keep
                )
                for key in chunk:
                    if key not in destinations:  # dropped, or no slot in time
                        fill.results[key] = EntryStatus.FAILED
                        core._prune_block_record(key)
                reserved = tuple(k for k in chunk if k in destinations)
                slots = tuple(
                    tuple(core._block_record(k).local_dram.slots) for k in reserved
                )
            if not reserved:
                continue
            part = FillPart(reserved, slots, size * len(reserved))
            pairs = [
                (blocks[key][1], SlotRef(label.partition(":")[0], address, size, slot))
                for key, ((_, slot),) in zip(reserved, slots, strict=True)
            ]
            # Queued now: the copy of this chunk runs while the next is reserved.
            # A chunk without a job (start raised) completes failed.
            try:
                part.job = copier.start(pairs, fill.deadline, wake)
            finally:
                fill.parts.append(part)
    with core._state_lock:
        for key, status in fill.results.items():
            # A READY key this deposit's own reservations evicted is not stored.
            if status is EntryStatus.SUCCESS and not _is_ready(core, key):
                fill.results[key] = EntryStatus.FAILED
                core._prune_block_record(key)


def poll(kv: Any, fill: PageFill) -> dict[bytes, EntryStatus] | None:
    """Owner thread: every key's result once every chunk's copy is over and the
    fills it waits on resolved, else None. Each chunk's slots are completed as
    soon as its copy is over (READY when every byte landed). Past the deadline a
    copy not started is dropped (failed); one already running is waited for and
    counts as it ends."""
    from kvcr.local_dram import _LocalDramState

    now = time.monotonic()
    if not fill.cancelled and now >= fill.deadline:
        fill.cancelled = True
        for job in fill.jobs:
            job.cancel()  # dropped only if it never started
    core = kv._core
    over = True
    with core._state_lock:
        for part in fill.parts:
            if not part.keys:
                continue
            landed = False if part.job is None else part.job.poll()
            if landed is None:
                over = False
            else:
                _complete(core, fill, part, bool(landed))
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
    if not over or fill.waiting:
        return None
    return fill.results


def abandon(kv: Any, fill: PageFill) -> bool:
    """Owner thread, at close: drop the copies not started; whether no byte of
    any can still be written (the slots of every chunk whose copy is over are
    freed; a running one's stay until it ends)."""
    running = False
    core = kv._core
    for part in fill.parts:
        if part.job is not None:
            part.job.cancel()
            if part.job.poll() is None:
                running = True
                continue
        if part.keys:
            with core._state_lock:
                _complete(core, fill, part, False)
    return not running


def _complete(core: Any, fill: PageFill, part: FillPart, success: bool) -> None:
    """Apply one chunk's copy outcome through kvcr (READY or freed), record it."""
    from kvcr.types import CacheTier

    done, part.keys = part.keys, ()
    if not batched_slots.commit_landed(core, done, part.slots, success):
        core._local_dram._apply_fill_result(done, part.slots, success, CacheTier.FW_G2)
    core._record_transfer("local_fill", fill.started, success, len(done), part.nbytes)
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
