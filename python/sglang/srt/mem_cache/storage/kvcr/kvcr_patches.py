"""Every use of kvcr 0.1.1's private names, in one place (as integration.py is
for SGLang's).

- Idle pacing of ``kvcr-progress``: kvcr's progress loop wakes every millisecond
  while idle and runs Python each time, so an idle worker takes the GIL a thousand
  times a second next to the model's forward. Once installed, an idle iteration
  (no submissions, operations, transfers or results, and none for 50 ms) waits up
  to ``progress_idle_ms`` instead, and any command the adapter hands KVCR wakes
  every progress loop at once, so this worker's own operations start without
  delay; only a peer's first request to a worker idle for 50 ms can wait up to the
  idle period. ``progress_idle_ms = 0`` leaves kvcr's own loop untouched. kvcr
  offers no such setting, so ``_KVCRProgress._run_one_iteration`` is wrapped once
  per process.
- NIXL's busy-polling progress thread on or off (``nixl_progress_thread``): kvcr
  offers no switch, so its ``nixl_agent_config`` is wrapped once.
- Whether a KVCR whose close failed has since become quiescent
  (``core_is_quiescent``: kvcr exposes it on its core only), and how many
  residency claims a KVCR holds (``public_claims``, for shutdown checks).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

# After any work the loop keeps kvcr's 1 ms pace this long before backing off.
_RECENT_S = 0.05
_COND = threading.Condition()
_LOCK = threading.Lock()
_generation = 0
_idle_s = 0.0
_installed = False


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
        if cls is None or original is None:
            logger.warning(
                "kvcr has no progress loop to pace (not kvcr 0.1.1?); "
                "progress_idle_ms has no effect"
            )
            return

        cls._run_one_iteration = _paced(original)
        _installed = True


def _paced(original: Any) -> Any:
    """``original`` (one progress iteration) that waits out idle periods."""

    def paced(self: Any) -> bool:
        seen = _generation
        did = original(self)
        idle = _idle_s
        now = time.monotonic()
        if (
            did
            or idle <= 0
            or getattr(self, "_in_flight_ops", True)
            or getattr(self, "_active_transfers", None)
            or getattr(self, "_completed_backlog", True)
            or getattr(self, "_stop_requested", True)
        ):
            self._kvcr_pacer_active = now
            return bool(did)
        if now - getattr(self, "_kvcr_pacer_active", 0.0) < _RECENT_S:
            return False  # just busy (a peer may be mid-exchange): kvcr's 1 ms
        with _COND:
            _COND.wait_for(lambda: _generation != seen, timeout=idle)
        return True  # the loop re-polls at once instead of sleeping again

    return paced


def wake() -> None:
    """Work was handed to KVCR: every paced progress loop polls now."""
    global _generation
    if not _installed:
        return
    with _COND:
        _generation += 1
        _COND.notify_all()


_PROGRESS_LOCK = threading.Lock()
_progress_enabled = True
_progress_patched = False


class progress_thread_setting:
    """Build a KVCR with NIXL's busy-polling progress thread on or off; the lock
    makes the setting per construction."""

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled

    def __enter__(self) -> None:
        global _progress_enabled, _progress_patched
        _PROGRESS_LOCK.acquire()
        if not _progress_patched:
            import kvcr.progress as progress

            original = progress.nixl_agent_config

            def config(*args: Any, **kwargs: Any) -> Any:
                return original(
                    *args, **{**kwargs, "enable_prog_thread": _progress_enabled}
                )

            progress.nixl_agent_config = config
            _progress_patched = True
        _progress_enabled = self._enabled

    def __exit__(self, *exc: object) -> None:
        _PROGRESS_LOCK.release()


def core_is_quiescent(kv: Any) -> bool:
    """Whether native progress can no longer touch ``kv``'s backend resources."""
    return bool(kv._core.is_quiescent())


def public_claims(kv: Any) -> int:
    """Residency claims ``kv`` holds for its framework."""
    return len(kv._core._local_dram._public_claims)
