"""Wake the owner thread when kvcr 0.1.1's progress loop hands it work.

kvcr's progress thread passes what the owner thread must handle (a peer's pin
request, a transfer's end, a fill's result, the loop's own failure) through
``_KVCRProgress._completed``, which only ``poll_completed`` on the owner thread
reads; kvcr signals nothing. The adapter therefore polled every 50 ms while idle,
taking the GIL next to the forward and leaving a peer's pin request waiting up
to that long. ``on_published`` wraps ``_publish_completed`` (once, for every
loop) so that a loop that was given a callback calls it after it published at
least one item, or after the loop failed (and, when it failed, before its
cleanup, ``_close_progress_ops``); the adapter's callback queues a
no-op command that wakes its owner thread at once. ``completed_waiting`` says
whether items are still queued (``take_completed`` reads a batch at a time), so
the owner polls again without waiting.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import kvcr_internals

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_wrapped: set[type] = set()  # progress classes whose methods wake owners


def _loop_of(kv: Any) -> Any:
    return getattr(getattr(kv, "_core", None), "_progress", None)


def on_published(kv: Any, wake: Callable[[], object]) -> bool:
    """Call ``wake`` (from kvcr's progress thread) whenever ``kv``'s loop hands
    the owner thread work. False, and nothing changed, when ``kv`` has no
    kvcr progress loop (a stand-in); ``KVCRInternalsChanged`` when the installed
    kvcr is not the one whose loop this wraps."""
    loop = _loop_of(kv)
    if loop is None:
        return False
    cls = kvcr_internals.progress_class()
    if not isinstance(loop, cls):
        return False
    with _LOCK:
        if cls not in _wrapped:
            cls._publish_completed = _publishing(cls._publish_completed)
            cls._close_progress_ops = _closing(cls._close_progress_ops)
            _wrapped.add(cls)
    loop._kvcr_on_publish = wake
    return True


class CoalescedWake:
    """``wake`` for ``on_published``, called once until the owner's next poll
    (``polled``): a loop publishing twice an iteration queues one wake."""

    __slots__ = ("_queued", "_wake")

    def __init__(self, wake: Callable[[], object]) -> None:
        self._wake = wake
        self._queued = False

    def __call__(self) -> None:  # kvcr's progress thread
        if not self._queued:
            self._queued = True
            self._wake()

    def polled(self) -> None:
        """The owner is about to poll: a publish from now on wakes it again."""
        self._queued = False


def completed_waiting(kv: Any) -> bool:
    """Whether ``kv``'s loop has published items ``poll_completed`` has not
    taken yet (False when it has no loop this module knows)."""
    completed = getattr(_loop_of(kv), "_completed", None)
    empty = getattr(completed, "empty", None)
    return empty is not None and not empty()


def _wake_owner(loop: Any) -> None:
    wake = getattr(loop, "_kvcr_on_publish", None)
    if wake is None:
        return
    try:
        wake()
    except Exception:  # never fail kvcr's loop for a wake-up
        logger.debug("KVCR owner wake-up failed", exc_info=True)


def _publishing(original: Callable[[Any, int], int]) -> Callable[[Any, int], int]:
    def publishing(self: Any, limit: int) -> int:
        count = original(self, limit)
        if count or getattr(self, "_failure", None) is not None:
            _wake_owner(self)
        return count

    publishing.__wrapped__ = original  # type: ignore[attr-defined]
    return publishing


def _closing(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """The loop's cleanup (up to 5 s of closing its operations) comes before its
    last publish: a loop that failed tells the owner first."""

    def closing(self: Any) -> None:
        if getattr(self, "_failure", None) is not None:
            _wake_owner(self)
        original(self)

    closing.__wrapped__ = original  # type: ignore[attr-defined]
    return closing
