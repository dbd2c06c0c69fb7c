"""Deposits copied by the linker, not by NIXL: one copy from the pool into KVCR DRAM.

kvcr 0.1.1 fills a deposit's slots with a NIXL WRITE from this agent to itself
(``local_dram._LocalCopyOp``), several times slower than a plain copy and, on a
GPU, a second copy after the staging one. Everything else a deposit does stays
kvcr's: slot allocation and eviction, the FILLING state, the deadline, and on the
op's result the READY mark, inventory events and claims (``_apply_fill_result``).
Once ``install`` ran, a deposit's copy op of a KVCR that ``attach`` gave a copier
hands its (source, slot) pairs to that copier instead and completes only when the
copier says every byte landed (or that it failed: the slots are then freed, never
marked READY). A copy not yet started when its deadline passes is dropped; one
already running is waited for, so a failed op never frees slots a copy still
writes. Deliveries and peer transfers keep NIXL. The copier sees plain tuples,
never kvcr's types; ``install`` checks kvcr's internals are the 0.1.1 ones and
refuses to start otherwise.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Protocol

KVCR_VERSION = "0.1.1"
_OP_FIELDS = (
    "deliver_op_id",
    "src_descriptors",
    "dst_descriptors",
    "deadline",
    "clock",
    "success",
    "cancellation_requested",
)


class LocalCopyUnsupported(RuntimeError):
    """The installed kvcr is not the one whose deposit internals this patches."""


@dataclasses.dataclass(frozen=True, slots=True)
class SlotRef:
    """One destination slot: KVCR pool ``pool`` at ``address`` (as kvcr has it),
    slots of ``slot_bytes``, slot number ``slot``. Deadlines are ``time.monotonic``
    (kvcr's clock)."""

    pool: str
    address: int
    slot_bytes: int
    slot: int


class CopyJob(Protocol):
    def poll(self) -> bool | None:
        """None while bytes may still be written, else whether all landed."""

    def cancel(self) -> None:
        """Drop the copy if it has not started (its poll then says False)."""


class LocalCopier(Protocol):
    def start(
        self, sources: list[tuple[str, int]], slots: list[SlotRef], deadline: float
    ) -> CopyJob | None:
        """Queue copying framework element ``sources[i]`` (label, index) into
        ``slots[i]``; None when it cannot (kvcr's NIXL copy runs instead)."""


_LOCK = threading.Lock()
_installed = False
# Progress object of a KVCR -> (its copier, its DRAM pools: name -> (address, slot bytes)).
_ATTACHED: weakref.WeakKeyDictionary[
    Any, tuple[LocalCopier, dict[str, tuple[int, int]]]
]
_ATTACHED = weakref.WeakKeyDictionary()


def install() -> None:
    """Patch kvcr's deposit copy once per process; raises ``LocalCopyUnsupported``
    naming what differs when kvcr is not 0.1.1."""
    global _installed
    with _LOCK:
        if _installed:
            return
        from importlib.metadata import version as dist_version

        from kvcr import local_dram

        version = dist_version("kvcr")
        op_cls = getattr(local_dram, "_LocalCopyOp", None)
        fields = getattr(op_cls, "__dataclass_fields__", {})
        missing = [f for f in _OP_FIELDS if f not in fields]
        if version != KVCR_VERSION or op_cls is None or missing:
            raise LocalCopyUnsupported(
                f"kvcr {version} is installed; the one-copy offload patches kvcr "
                f"{KVCR_VERSION}'s local DRAM copy (missing: {missing or 'none'}): "
                f"pip install kvcr=={KVCR_VERSION}"
            )
        original_progress = op_cls.progress
        original_close = op_cls.close

        def progress(self: Any, prog: Any, event: object | None) -> tuple[bool, bool]:
            job = self.__dict__.get("_kvcr_copy_job")
            if job is None:
                job = _start(self, prog)
                if job is None:
                    return original_progress(self, prog, event)
                if job is _EXPIRED:
                    return True, True  # success stays False: slots freed
                self.__dict__["_kvcr_copy_job"] = job
                return False, True
            if event is not None:
                raise RuntimeError(f"unexpected local-copy event: {event!r}")
            if not self.cancellation_requested and self.clock() >= self.deadline:
                self.cancellation_requested = True
                job.cancel()
            landed = job.poll()
            if landed is None:
                return False, False
            self.success = bool(landed) and not self.cancellation_requested
            return True, True

        def close(self: Any, prog: Any) -> bool:
            job = self.__dict__.get("_kvcr_copy_job")
            if job is None:
                return bool(original_close(self, prog))
            self.cancellation_requested = True
            job.cancel()
            return job.poll() is not None  # closed once nothing writes the slots

        op_cls.progress = progress
        op_cls.close = close
        _installed = True


_EXPIRED: Any = object()


def _start(op: Any, prog: Any) -> Any:
    """The copier's job for ``op``, ``_EXPIRED`` past its deadline, or None
    (not a deposit of an attached KVCR: kvcr's own NIXL copy runs)."""
    attached = _ATTACHED.get(prog)
    if attached is None or op.deliver_op_id is not None:
        return None
    copier, pools = attached
    agent = prog.nixl_agent_name
    sources, slots = [], []
    for src, dst in zip(op.src_descriptors, op.dst_descriptors, strict=True):
        pool = pools.get(dst.label.partition(":")[0])
        if (
            not src.framework
            or dst.framework
            or src.end_point_name != agent
            or dst.end_point_name != agent
            or pool is None
        ):
            return None
        sources.append((src.label, src.element_index))
        slots.append(SlotRef(dst.label.partition(":")[0], *pool, dst.element_index))
    if op.clock() >= op.deadline:
        return _EXPIRED
    return copier.start(sources, slots, op.deadline)


def attach(kv: Any, copier: LocalCopier) -> None:
    """Let ``copier`` fill the deposits of ``kv`` (a started ``kvcr.KVCR``)."""
    install()
    core = kv._core
    pools = {
        name: (address, slot_bytes)
        for name, (address, _length, slot_bytes) in core._local_dram._pools.items()
    }
    _ATTACHED[core._progress] = (copier, pools)
