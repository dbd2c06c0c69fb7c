"""Wake the owner thread when kvcr 0.1.1's progress loop hands it work.

kvcr's progress thread passes what the owner thread must handle (a peer's pin
request, a transfer's end, a fill's result, the loop's own failure) through
``_KVCRProgress._completed``, which only ``poll_completed`` on the owner thread
reads; kvcr signals nothing. The adapter therefore polled every 50 ms while idle,
taking the GIL next to the forward and leaving a peer's pin request waiting up
to that long. ``on_published`` wraps ``_publish_completed`` (once, for every
loop) so that a loop that was given a callback calls it after it published at
least one item, or after the loop failed; the adapter's callback queues a
no-op command that wakes its owner thread at once. ``completed_waiting`` says
whether items are still queued (``take_completed`` reads a batch at a time), so
the owner polls again without waiting.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_installed = False


def _loop_of(kv: Any) -> Any:
    return getattr(getattr(kv, "_core", None), "_progress", None)


def on_published(kv: Any, wake: Callable[[], object]) -> bool:
    """Call ``wake`` (from kvcr's progress thread) whenever ``kv``'s loop hands
    the owner thread work. False, and nothing changed, when ``kv`` has no
    progress loop this module knows (a stand-in, or not kvcr 0.1.1)."""
    loop = _loop_of(kv)
    if loop is None or not _install(type(loop)):
        return False
    if not hasattr(loop, "_completed") or not hasattr(loop, "_failure"):
        return False
    loop._kvcr_on_publish = wake
    return True


def completed_waiting(kv: Any) -> bool:
    """Whether ``kv``'s loop has published items ``poll_completed`` has not
    taken yet (False when it has no loop this module knows)."""
    completed = getattr(_loop_of(kv), "_completed", None)
    empty = getattr(completed, "empty", None)
    return empty is not None and not empty()


def _install(cls: type) -> bool:
    """Wrap ``cls._publish_completed`` once; whether it is wrapped."""
    global _installed
    with _LOCK:
        if _installed:
            return True
        original = getattr(cls, "_publish_completed", None)
        if original is None:
            logger.warning(
                "kvcr's progress loop has no _publish_completed (not kvcr "
                "0.1.1?): the owner thread keeps polling while idle"
            )
            return False
        cls._publish_completed = _publishing(original)  # type: ignore[attr-defined]
        _installed = True
        return True


def _publishing(original: Callable[[Any, int], int]) -> Callable[[Any, int], int]:
    def publishing(self: Any, limit: int) -> int:
        count = original(self, limit)
        if count or getattr(self, "_failure", None) is not None:
            wake = getattr(self, "_kvcr_on_publish", None)
            if wake is not None:
                try:
                    wake()
                except Exception:  # never fail kvcr's loop for a wake-up
                    logger.debug("KVCR owner wake-up failed", exc_info=True)
        return count

    publishing.__wrapped__ = original  # type: ignore[attr-defined]
    return publishing
