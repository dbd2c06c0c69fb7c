"""Host buffers for KVCR DRAM and offload staging, page-locked at exactly their size.

``torch.zeros(n, pin_memory=True)`` goes through torch's caching host allocator,
which rounds every request up to a power of two: a 20 GiB KVCR share would lock
32 GiB of host memory. On GPU hosts this module allocates a plain (pageable) tensor
aligned to the OS page and page-locks exactly its bytes with ``cudaHostRegister``
(portable, so every device's context can DMA from it), and unregisters it when the
owner releases it. The bytes locked so far are counted for the stats line. On CPU
hosts nothing is locked. The register/unregister calls are injectable so a CPU test
can count what a GPU host would lock.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

_ALIGN = mmap.PAGESIZE
# Buffers quarantined by any linker: referenced here so their memory is never
# freed (or unlocked) under a transfer that may still write it.
_QUARANTINED: list[torch.Tensor] = []
_PORTABLE = 1  # cudaHostRegisterPortable


class HostMemoryError(RuntimeError):
    """Host memory could not be page-locked (the message names the size)."""


def _cuda_register(ptr: int, nbytes: int) -> None:
    res = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE))
    if res != 0:
        raise HostMemoryError(
            f"cudaHostRegister of {nbytes} bytes failed (cudaError {res}); lower "
            "local_dram_bytes_per_worker or max_inflight_offload_bytes in "
            "--unified-cache-external-linker-config (the host cannot lock that much "
            "memory next to what it already holds)"
        )


def _cuda_unregister(ptr: int) -> None:
    res = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if res != 0:
        logger.warning("cudaHostUnregister failed (cudaError %d)", res)


class HostMemory:
    """Allocates zeroed ``uint8`` host tensors; locks them when ``pin`` is set."""

    def __init__(
        self,
        pin: bool,
        *,
        register: Callable[[int, int], None] | None = None,
        unregister: Callable[[int], None] | None = None,
    ) -> None:
        self.pin = pin
        self._register = register or _cuda_register
        self._unregister = unregister or _cuda_unregister
        self._locked: dict[int, int] = {}  # data_ptr -> bytes locked
        self._kept: set[int] = set()  # quarantined: never unlocked

    @property
    def pinned_bytes(self) -> int:
        return sum(self._locked.values())

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A zeroed host tensor of exactly ``nbytes`` (locked when pinning)."""
        if not self.pin or nbytes == 0:
            return torch.zeros(nbytes, dtype=torch.uint8)
        raw = torch.empty(nbytes + _ALIGN, dtype=torch.uint8)
        skip = -raw.data_ptr() % _ALIGN
        buf = raw[skip : skip + nbytes]  # the view keeps ``raw`` alive
        buf.zero_()
        self._register(buf.data_ptr(), nbytes)
        self._locked[buf.data_ptr()] = nbytes
        return buf

    def alloc_like(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zeroed ``uint8`` tensor of ``shape`` from :meth:`alloc`."""
        n = 1
        for dim in shape:
            n *= dim
        return self.alloc(n).view(shape)

    def release(self, buf: torch.Tensor) -> None:
        """Unlock ``buf`` (the caller drops its last reference afterwards)."""
        nbytes = self._locked.pop(buf.data_ptr(), None)
        if nbytes is not None:
            self._unregister(buf.data_ptr())

    def release_all(self) -> None:
        """Unlock every buffer not quarantined (startup failed, nothing ran)."""
        for ptr in list(self._locked):
            if ptr not in self._kept:
                del self._locked[ptr]
                self._unregister(ptr)

    def quarantine(self, buf: torch.Tensor) -> None:
        """Keep ``buf`` alive and locked until :meth:`reclaim`: a transfer that
        never proved it stopped may still write it. Still counted."""
        _QUARANTINED.append(buf)
        self._kept.add(buf.data_ptr())

    def reclaim(self, buf: torch.Tensor) -> None:
        """``buf``'s core has since proven quiescent: it may be reused (still
        locked, so reuse costs no new registration)."""
        self._kept.discard(buf.data_ptr())
        for i, kept in enumerate(_QUARANTINED):
            if kept is buf:
                del _QUARANTINED[i]
                break
