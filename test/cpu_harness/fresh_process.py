"""Run one function in a fresh spawned interpreter, so its damage dies with it.

A CUDA device-side assert is sticky: every later CUDA call in the process that
raised it fails, so a test that may provoke one (the GPU data path's negative
control, which removes the restore's fences) would error every CUDA test after
it. ``run_isolated(fn, *args, timeout_s=...)`` runs ``fn(*args)`` in a spawned
process of its own (``gloo_ranks.run_ranks`` with one rank, which joins no
group), returns what it returned, and fails the calling test with the child's
traceback when it raised, died or stayed silent past ``timeout_s``. Nothing the
child patches, allocates or breaks reaches the caller. ``fn`` is a module-level
function (spawn imports it by name) and its arguments and result pickle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cpu_harness import gloo_ranks


def run_isolated(
    fn: Callable[..., Any], *args: Any, timeout_s: float, name: str = "kvcr-isolated"
) -> Any:
    """``fn(*args)``, run in a fresh spawned process (see the module docstring)."""
    out = gloo_ranks.run_ranks(_alone, 1, fn, args, timeout_s=timeout_s, name=name)
    return out[0]


def _alone(rank: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    return fn(*args)
