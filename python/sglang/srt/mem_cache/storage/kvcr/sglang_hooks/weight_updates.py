"""Announce weight updates to a preparing linker before the weights change.

Every SGLang weight-manager entry point that replaces the served weights (disk,
tensor, distributed and IPC updates, the start of a weight-update session
(``begin_weight_update``), a P2P/RDMA session ended without a load,
``check_weights`` resetting tensors, a memory resume without a CPU backup of
the weights) is wrapped (AROUND) so the linker's ``weights_changing`` runs first:
from then on it refuses restores and offloads until a flush re-keys it. An update
that fails is announced again as failed (the weights are then unknown).
``integration`` registers these hooks with the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    cache_linker_of,
    linker_hook,
)

_WEIGHTS = (
    "sglang.srt.managers.scheduler_components.weight_updater"
    ".SchedulerWeightUpdaterManager"
)
WEIGHT_TARGETS: tuple[str, ...] = tuple(
    f"{_WEIGHTS}.{name}"
    for name in (
        "update_weights_from_disk",
        "update_weights_from_tensor",
        "update_weights_from_distributed",
        "update_weights_from_ipc",
        "begin_weight_update",
        "end_weight_update",  # P2P/RDMA writes land between begin and end
        "check_weights",  # action="reset_tensors" randomizes every parameter
        "resume_memory_occupation",  # weights without a CPU backup: undefined
    )
)


def around_weight_update(
    original: Callable[..., Any], manager: Any, recv_req: Any, *args: Any, **kw: Any
) -> Any:
    """Tell the backend before the weights change; a failed update leaves them
    unknown (partly loaded, or rolled back), so it is announced again as such."""
    scheduler = getattr(manager, "scheduler", None)
    backend = cache_linker_of(getattr(scheduler, "tree_cache", None))
    if backend is None:
        return original(manager, recv_req, *args, **kw)
    source = original.__name__.removeprefix("update_weights_from_")
    if not _changes_weights(source, manager, recv_req):
        return original(manager, recv_req, *args, **kw)
    changing = linker_hook(backend, "weights_changing")
    if source == "disk":
        changing(source, recv_req.model_path, recv_req.load_format)
    else:
        changing(source)
    result = original(manager, recv_req, *args, **kw)
    if getattr(result, "success", True) is False:
        changing(f"{source} (failed)")
    return result


def _changes_weights(source: str, manager: Any, recv_req: Any) -> bool:
    """Whether this weight-manager call replaces the served weights."""
    if source == "end_weight_update":
        # Loads inside the session flushed (and so re-keyed) already; only a
        # session without one (P2P/RDMA writes) changed the weights unseen.
        session = getattr(manager, "_session", None)
        return session is not None and not getattr(session, "loaded_weights", False)
    if source == "check_weights":
        return getattr(recv_req, "action", None) == "reset_tensors"
    if source == "resume_memory_occupation":
        from sglang.srt.constants import GPU_MEMORY_TYPE_WEIGHTS

        tags = getattr(recv_req, "tags", None)
        weights = not tags or GPU_MEMORY_TYPE_WEIGHTS in tags
        return weights and not _weights_backed_up()
    return True


def _weights_backed_up() -> bool:
    """Whether released weights are restored from a CPU copy (then a resume
    brings back exactly the weights that were served)."""
    try:
        from sglang.srt.runtime_context import get_exec

        return bool(get_exec().features.enable_weights_cpu_backup)
    except Exception:  # not published in this process: assume no backup
        return False
