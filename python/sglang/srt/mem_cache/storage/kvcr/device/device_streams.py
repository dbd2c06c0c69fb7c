"""The device a linker's side threads work on, their streams, and the fences they wait on.

A side thread (the restore loader, the offload stager) starts on device 0 whatever
rank it serves, so each captures its pool's device at construction, calls
``torch.cuda.set_device`` before it touches CUDA and creates its stream on that
device. Work a side stream does on pages the forward may still touch is ordered by
events: an offload waits on ``record_offload_ready()``'s events, a restore waits on
the events :meth:`DeviceBinding.record_fences` takes at ``start_layer_wise_loading``
(the scheduler's current stream, which computed the destination indices, and the
forward stream, whose launched batch may still write pages the allocator already
handed out again). On CPU every method is a no-op, so the same code runs in tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceBinding:
    """The device of one linker's KV pools (``cpu`` or ``cuda:N``)."""

    device: torch.device

    @classmethod
    def of(cls, device: Any) -> DeviceBinding:
        """Binding for ``device``; a bare ``cuda`` resolves to the calling thread's
        current device (SGLang builds a rank's pools after ``set_device``)."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return cls(dev)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def bind_thread(self) -> None:
        """Make this thread's current CUDA device the pools' device."""
        if self.is_cuda:
            torch.cuda.set_device(self.device)

    def new_stream(self) -> Any:
        """A side stream on the pools' device (None on CPU)."""
        return torch.cuda.Stream(device=self.device) if self.is_cuda else None

    def start_side_thread(self, what: str) -> tuple[Any, BaseException | None]:
        """Bind this side thread and make its stream: ``(stream, None)``, or
        ``(None, error)`` logged once with ``what`` (the thread then fails
        every job it gets, so nothing waits on it forever)."""
        try:
            self.bind_thread()
            return self.new_stream(), None
        except BaseException as exc:
            logger.exception("KVCR %s", what)
            return None, exc

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        """Launch on ``stream`` (nothing to do on CPU)."""
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield

    def mark(self, stream: Any) -> Any:
        """An event after everything queued on ``stream`` so far; None on CPU
        (or without a stream), where nothing is ever queued."""
        if stream is None or not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def record_fences(self, forward_stream: Any) -> tuple[Any, ...]:
        """Events on the current stream and on ``forward_stream`` (no host sync)."""
        if not self.is_cuda:
            return ()
        fences = []
        for stream in (torch.cuda.current_stream(self.device), forward_stream):
            if stream is None:
                continue
            event = torch.cuda.Event()
            event.record(stream)
            fences.append(event)
        return tuple(fences)


def wait_fences(stream: Any, fences: Sequence[Any]) -> None:
    """Order ``stream`` after ``fences`` on the device (the host does not block)."""
    if stream is None:
        return
    for event in fences:
        stream.wait_event(event)


class DeviceStallError(RuntimeError):
    """A side stream did not drain by its deadline (the device is wedged)."""


DRAIN_TIMEOUT_S = 60.0


def drain(stream: Any, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Block this (side) thread until everything queued on ``stream`` is done;
    ``DeviceStallError`` past the deadline. CPU: nothing is ever queued."""
    if stream is not None:
        _poll(stream, timeout_s, "a KVCR side stream did not drain")


def wait_event(event: Any, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Block this (side) thread until ``event`` has completed, with a deadline."""
    _poll(event, timeout_s, "a KVCR copy did not complete")


# A wait polls at most this long apart for its first _FINE_S (a restore's copy
# is milliseconds: a 1 ms sleep would add up to 1 ms to it), then at _COARSE_S.
_FINE_PAUSE_S = 50e-6
_FINE_S = 0.05
_COARSE_PAUSE_S = 1e-3


FIRST_PAUSE_S = 5e-6


def next_pause(pause: float, waited_s: float) -> float:
    """The pause after ``pause`` in a poll that has waited ``waited_s``: doubling
    from ``FIRST_PAUSE_S``, capped at 50 us for the first 50 ms, then at 1 ms."""
    return min(pause * 2, _FINE_PAUSE_S if waited_s < _FINE_S else _COARSE_PAUSE_S)


def _poll(waitable: Any, timeout_s: float, what: str) -> None:
    start = time.monotonic()
    deadline = start + timeout_s
    pause = FIRST_PAUSE_S
    while not waitable.query():
        now = time.monotonic()
        if now >= deadline:
            raise DeviceStallError(f"{what} within {timeout_s:.0f} s")
        pause = next_pause(pause, now - start)
        time.sleep(pause)
    # Done: returns at once, and tells PyTorch's CUDA sanitizer the work is
    # synchronized (a query() does not count as a synchronization for it).
    sync = getattr(waitable, "synchronize", None)
    if sync is not None:
        sync()


def device_index(values: Sequence[int], device: Any) -> torch.Tensor:
    """``values`` as an int64 index on ``device``, queued on the current stream
    without blocking the host: on CUDA through page-locked memory (torch's host
    allocator keeps that block until the copy has run), since a pageable copy
    would first wait for everything queued on the stream."""
    cuda = torch.device(device).type == "cuda"
    index = torch.tensor(values, dtype=torch.long, pin_memory=cuda)
    return index.to(device, non_blocking=True)


def fences_done(fences: Sequence[Any]) -> bool:
    """Whether every event has completed, without blocking."""
    return all(event.query() for event in fences)
