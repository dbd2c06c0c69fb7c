"""Idle pacing of kvcr 0.1.1's progress loop (``_KVCRProgress._run_one_iteration``).

kvcr's loop wakes every millisecond while idle and runs Python each time, so an
idle worker takes the GIL a thousand times a second next to the model's forward.
Once installed (``configure`` with ``progress_idle_ms > 0``), an idle iteration
(no submissions, operations, transfers or results, and no work for ``RECENT_S``)
blocks instead, up to ``progress_idle_ms``, on what hands an idle KVCR work: its
control channel's PULL socket (a peer's message) and this loop's wake descriptor,
written by every ``_KVCRProgress.submit`` (work kvcr queues for the loop from
another thread, its owner thread's ``poll_completed`` among them) and by
``wake`` (the adapter handed KVCR a command). Neither this worker's operations
nor a peer's first message wait out the idle period; what kvcr does on timers
alone (deadlines) runs at least once per period, which the config keeps at a
quarter of ``operation_timeout_ms`` or less. While anything is in flight, and for
``RECENT_S`` after any work (a notice NIXL sent may still need the worker
progressed when its progress thread is off; a fresh endpoint may be wiring up),
the loop keeps kvcr's own 1 ms pace: NIXL notices and transfer states are polled,
not signalled. A KVCR whose control channel has no socket this module can wait
on keeps kvcr's 1 ms pace throughout, rather than miss a peer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

# After any work the loop keeps kvcr's 1 ms pace this long before it blocks.
RECENT_S = 0.005
_LOCK = threading.Lock()  # configure() and the descriptor set
_idle_s = 0.0
_installed = False
# One eventfd per paced progress loop, made and closed by that loop's own thread;
# written by wake(), closed only under _LOCK (a descriptor number written after
# its close could be someone else's file).
_WAKE_FDS: set[int] = set()


def configure(idle_ms: int) -> None:
    """Set the idle wait (process-wide) and install the wrapper when it is > 0."""
    global _idle_s, _installed
    with _LOCK:
        _idle_s = max(0, idle_ms) / 1000.0
        if _installed or _idle_s == 0:
            return
        from kvcr import progress

        cls = getattr(progress, "_KVCRProgress", None)
        original = getattr(cls, "_run_one_iteration", None)
        submit = getattr(cls, "submit", None)
        if cls is None or original is None or submit is None:
            logger.warning(
                "kvcr has no progress loop to pace (not kvcr 0.1.1?); "
                "progress_idle_ms has no effect"
            )
            return

        cls._run_one_iteration = _paced(original)
        cls.submit = _waking(submit)
        _installed = True


def pace(kv: Any, idle_ms: int) -> None:
    """Give ``kv``'s own progress loop its idle sleep. ``configure``'s value is
    process-wide (the last KVCR built sets it), and KVCRs whose operation
    timeouts differ, so whose sleeps differ, may share a process; until this
    runs, the loop uses that value."""
    loop = getattr(getattr(kv, "_core", None), "_progress", None)
    if loop is not None:
        loop._kvcr_idle_s = max(0, idle_ms) / 1000.0


def wake() -> None:
    """Work was handed to KVCR: every paced progress loop polls now."""
    with _LOCK:
        for fd in _WAKE_FDS:
            _write(fd)


def _write(fd: int) -> None:
    """Wake the loop of ``fd`` (under ``_LOCK``, ``fd`` still in ``_WAKE_FDS``)."""
    with contextlib.suppress(BlockingIOError):  # a full counter: already woken
        os.eventfd_write(fd, 1)


def _waking(submit: Any) -> Any:
    """``submit`` (queue work for a progress loop) that wakes that loop."""

    def waking_submit(self: Any, item: object) -> None:
        submit(self, item)
        fd = getattr(self, "_kvcr_wake_fd", None)
        if fd is None:
            return  # not waiting yet (it polls before its first wait)
        with _LOCK:
            if fd in _WAKE_FDS:  # still a paced loop's descriptor
                _write(fd)

    waking_submit.__wrapped__ = submit  # type: ignore[attr-defined]
    return waking_submit


def _busy(loop: Any) -> bool:
    return bool(
        getattr(loop, "_in_flight_ops", True)
        or getattr(loop, "_active_transfers", None)
        or getattr(loop, "_completed_backlog", True)
        or getattr(loop, "_stop_requested", True)
    )


def _paced(original: Any) -> Any:
    """``original`` (one progress iteration) that waits out idle periods."""

    def paced(self: Any) -> bool:
        fd = _wake_fd(self)
        if fd is not None:
            _drain(fd)  # wakes before this iteration are served by it
        try:
            did = original(self)
        except BaseException:  # kvcr's loop ends with its failure
            _forget(self)
            raise
        idle, now = getattr(self, "_kvcr_idle_s", _idle_s), time.monotonic()
        if getattr(self, "_stop_requested", False):
            _forget(self)  # the loop's last iteration
        if did or idle <= 0 or fd is None or _busy(self):
            self._kvcr_pacer_active = now
            return bool(did)
        if now - getattr(self, "_kvcr_pacer_active", 0.0) < RECENT_S:
            return False  # just worked: kvcr's 1 ms for a few more polls
        sources = _peer_socket(self)
        if sources is None:
            return False  # nothing to wait on for peers: kvcr's 1 ms
        _wait(fd, sources, idle)
        return True  # the loop re-polls at once instead of sleeping again

    return paced


def _wake_fd(loop: Any) -> int | None:
    """This progress loop's wake descriptor, made on its first iteration."""
    fd = getattr(loop, "_kvcr_wake_fd", None)
    if fd is not None or getattr(loop, "_stop_requested", False):
        return fd
    fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    with _LOCK:
        _WAKE_FDS.add(fd)
    loop._kvcr_wake_fd = fd  # closed by the loop's last iteration (_forget)
    return fd


def _forget(loop: Any) -> None:
    fd = getattr(loop, "_kvcr_wake_fd", None)
    if fd is not None:
        loop._kvcr_wake_fd = None
        _close(fd)


def _close(fd: int) -> None:
    with _LOCK:
        if fd in _WAKE_FDS:
            _WAKE_FDS.discard(fd)
            os.close(fd)


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):  # not woken since
        os.eventfd_read(fd)


_NO_CONTROL: tuple[()] = ()


def _peer_socket(loop: Any) -> tuple[Any, ...] | None:
    """What a peer's message arrives on: ``()`` for a KVCR without a control
    channel (no peer can reach it), its live ZMQ PULL socket, or ``None`` when
    the channel has none this module knows how to wait on."""
    backend = getattr(getattr(loop, "_poll", None), "__self__", None)
    control = getattr(backend, "_control", None)
    if control is None:
        return _NO_CONTROL
    sock = getattr(control, "_socket", None)
    if sock is None or getattr(sock, "closed", True):
        return None
    return (sock,)


def _wait(fd: int, sockets: tuple[Any, ...], idle_s: float) -> None:
    """Block until ``fd`` is woken, a socket has a message, or ``idle_s``."""
    import zmq

    poller = zmq.Poller()
    try:
        poller.register(fd, zmq.POLLIN)
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        poller.poll(timeout=max(1, round(idle_s * 1000)))
    except zmq.ZMQError:  # a socket closed under us: kvcr's next poll says so
        logger.debug("KVCR idle wait: poll failed", exc_info=True)
