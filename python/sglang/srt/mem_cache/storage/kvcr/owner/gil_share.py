"""How long the scheduler thread can wait for the GIL behind this package's threads.

The linker's side threads (the KVCR owner, its progress loop, the DRAM copier)
run Python next to the scheduler thread. A thread that wants the GIL waits up to
CPython's switch interval (5 ms by default) before it may make the holder drop it,
so a 2 ms kvcr slot reservation right after a prefill can hold a response that
long. ``share_gil`` lowers the process's switch interval to the configured bound
(``gil_switch_interval_us``), never raises one set lower, and logs when it
lowers it.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)


def share_gil(interval_us: int) -> float:
    """Lower ``sys.getswitchinterval()`` to ``interval_us`` (0: leave it);
    returns the interval in force, in seconds."""
    current = sys.getswitchinterval()
    wanted = interval_us / 1e6
    if interval_us <= 0 or wanted >= current:
        return current
    sys.setswitchinterval(wanted)
    logger.info(
        "KVCR: Python's GIL switch interval lowered from %.2f ms to %.2f ms "
        "(gil_switch_interval_us; 0 leaves it)",
        current * 1e3,
        wanted * 1e3,
    )
    return sys.getswitchinterval()
