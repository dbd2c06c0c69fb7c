"""Where SGLang 0.5.23's private names are used: scheduler and tree hooks (the
weight manager's lives beside it, in ``weight_updates``).

``register_hooks`` installs, through ``HookRegistry``, the hooks that give a
direct linker the prepare / ready / release / finish contract of ``linker_hooks``
(enqueue-time preparation, a MIN-reduced readiness gate before prefill admission,
per-request restore verdicts, release on abort), EXTERNAL stored marks and
KVCR-eviction gathering across ranks, and weight-update announcements; the docs'
"How it plugs into SGLang" lists every target and what each does. Linkers without
the optional hooks (Mooncake, mori) see no behaviour change: every hook returns at
once unless ``prepares_requests`` / ``publishes_external_events`` (the weight
announcement calls the no-op default ``weights_changing``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from sglang.srt.environ import envs

from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRUnavailableError
from sglang.srt.mem_cache.storage.kvcr.config.startup_checks import TREE_CORE_ENV
from sglang.srt.mem_cache.storage.kvcr.fleet.event_hashes import published_aliases
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import lora_namespace, stored_marks
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.hook_check import hook_status
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
    PreparationHandle,
    cache_linker_of,
    linker_hook,
    merge_held,
    preparing_linker_of,
)
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.session_pins import holds_sessions
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.weight_updates import (
    WEIGHT_TARGETS,
    around_weight_update,
)

logger = logging.getLogger(__name__)

_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_WRAPPER = (
    "sglang.srt.mem_cache.unified_cache.unified_cache_linker.UnifiedCacheLinkerWrapper"
)
_CACHE = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"

_PD_PREFILL = (
    "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin"
    ".optimistic_release_and_requeue"
)


def _hooks() -> list[tuple[str, Callable[..., Any], str]]:
    """Every (target, hook, kind) this module registers (kind: after/around)."""
    hooks: list[tuple[str, Callable[..., Any], str]] = [
        (f"{_SCHED}._add_request_to_queue", _after_add_request_to_queue, "after"),
        (
            f"{_SCHED}._get_new_batch_prefill_raw",
            _around_get_new_batch_prefill,
            "around",
        ),
        (f"{_WRAPPER}.release_request", _after_wrapper_release_request, "after"),
        (
            f"{_WRAPPER}.commit_completed_offloads",
            _around_commit_completed_offloads,
            "around",
        ),
        (f"{_WRAPPER}.finish_loads", _around_finish_loads, "around"),
        (f"{_CACHE}.on_release", _after_on_release, "after"),
        (f"{_CACHE}.check_hicache_events", _after_check_hicache_events, "after"),
        (f"{_CACHE}.init_cache_linker", _after_init_cache_linker, "after"),
        (f"{_CACHE}.reset", _after_cache_reset, "after"),
        (
            f"{_SCHED}._record_kv_event_lora_name",
            lora_namespace.around_record_lora_name,
            "around",
        ),
        (
            "sglang.srt.mem_cache.utils.storage_namespace_seed",
            lora_namespace.around_storage_seed,
            "around",
        ),
        (f"{_SCHED}.on_idle", _around_on_idle, "around"),
        (f"{_SCHED}.process_batch_result", _around_process_batch_result, "around"),
        (_PD_PREFILL, _after_optimistic_requeue, "after"),
    ]
    hooks += [(target, around_weight_update, "around") for target in WEIGHT_TARGETS]
    return hooks


def register_hooks() -> None:
    """Register every scheduler/tree hook with SGLang's HookRegistry."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    kinds = {"after": HookType.AFTER, "around": HookType.AROUND}
    for target, hook, kind in _hooks():
        HookRegistry.register(target, hook, kinds[kind])


def installed_hooks() -> dict[str, bool]:
    """Which hook targets currently carry this module's hook."""
    return hook_status(_hooks())


def require_hooks_installed() -> None:
    """Refuse to run a preparing linker whose scheduler hooks are missing."""
    missing = [t for t, ok in installed_hooks().items() if not ok]
    if missing:
        raise KVCRUnavailableError(
            f"KVCR linker hooks are not installed on {missing}; load the plugin "
            "(sglang.srt.plugins.load_plugins(), entry point 'kvcr') before the "
            "scheduler starts, and do not exclude it with SGLANG_PLUGINS"
        )


# ---- helpers ---------------------------------------------------------------


def wrapper_prepare_request(wrapper: Any, req: Any) -> Any:
    """Device-only match of ``req`` at enqueue (none when the tree has no node
    for its first page), then hand the tail to the backend.

    No ``lookup`` and no collective: ``match_prefix`` with ``req=None`` skips the
    linker. Every attention rank enqueues the same requests in the same order.
    """
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.common import _req_radix_key
    from sglang.srt.mem_cache.unified_cache.components.base import (
        LinkerTransferPhase,
    )

    cache = wrapper.cache
    # The scheduler's own token type (array('q')): the tree asserts key types match.
    tokens = req.origin_input_ids + req.output_ids
    if not tokens:
        return None
    key = _req_radix_key(cache, req, tokens, req._compute_max_prefix_len(len(tokens)))
    view, _ = key.maybe_to_bigram_view(cache.tree_core.is_eagle)
    kv_hints = getattr(req, "kv_hints", None)
    if kv_hints is None and _first_page_off_device(cache, view):
        # No walk: it would match nothing (a tree fact, alike on every rank).
        result = cache.tree_core.empty_match_result
    else:
        result = cache.match_prefix(
            MatchPrefixParams(key=key, cow_mamba=False, req=None)
        )
    start, last = result.device_prefix_len, result.last_device_node
    if start >= len(view):
        tail: list[str] = []
    elif kv_hints is None and not _tail_may_hit(wrapper, req.rid, view, start, last):
        return None  # a cold tail: nothing to prepare
    else:
        tail = wrapper._tail_hashes(view, result, start)
    transfers = []
    for component in wrapper._components:
        transfer = component.build_external_linker_transfer(
            LinkerTransferPhase.LOOKUP, None, tail
        )
        if transfer is None:
            return None
        transfers.append(transfer)
    handle = getattr(req, "cache_request_handle", None)
    ctx = LinkerRequestContext(
        rid=req.rid,
        attempt_id=int(getattr(handle, "attempt_id", 0) or 0),
        kv_hints=kv_hints,
        # What a router read from this request's published events (only needed
        # when a hint came with the request).
        event_hashes=(
            published_aliases(
                view, result.device_prefix_len, len(tail), cache.page_size
            )
            if kv_hints is not None and tail
            else ()
        ),
    )
    return linker_hook(wrapper.cache_linker, "prepare_request")(ctx, transfers)


def _first_page_off_device(cache: Any, view: Any) -> bool:
    """Whether the tree's root has no child under ``view``'s first page (as the
    walk looks it up): a device match of ``view`` would be empty."""
    page = cache.page_size
    return len(view) >= page and (
        view.child_key_at(0, page) not in cache.tree_core.root_node.children
    )


def _tail_may_hit(wrapper: Any, rid: str, view: Any, start: int, last: Any) -> bool:
    """The backend's ``tail_may_hit`` on the first page of ``view`` from token
    ``start`` (behind device node ``last``), hashed as the wrapper's
    ``_tail_hashes`` hashes it; True when there is no such hash."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    cache = wrapper.cache
    page = cache.page_size
    if len(view) - start < page:
        return True
    prior = None
    if start > 0:
        prior = cache.get_last_hash_value(last)
        if prior is None:
            return True
    first = get_storage_hash_str(view[start : start + page], prior, page_size=page)
    return bool(linker_hook(wrapper.cache_linker, "tail_may_hit")(rid, first[0]))


def wrapper_sync_preparation(wrapper: Any, reqs: list[Any]) -> list[bool]:
    """Readiness of ``reqs``, identical on every attention rank (MIN of 0/1)."""
    ready_fn = linker_hook(wrapper.cache_linker, "preparation_ready")
    flags = [int(bool(ready_fn(_handle(r)))) for r in reqs]
    return [bool(v) for v in _min_across_ranks(wrapper.cache, flags)]


def _min_across_ranks(cache: Any, flags: list[int]) -> list[int]:
    """The MIN of ``flags`` over the attention group, reduced as SGLang reduces
    (``_all_reduce_attn_groups``); as they are, with no tensor made, on a single
    attention rank (``stored_marks.reduce_groups``: no group to reduce over)."""
    if not stored_marks.reduce_groups(cache):
        return flags
    tensor = torch.tensor(flags, dtype=torch.int)
    cache._all_reduce_attn_groups(tensor, torch.distributed.ReduceOp.MIN)
    return [int(v) for v in tensor.tolist()]


def _handle(req: Any) -> PreparationHandle:
    handle = getattr(req, "cache_request_handle", None)
    return PreparationHandle(req.rid, int(getattr(handle, "attempt_id", 0) or 0))


def _prepare_safely(tree_cache: Any, req: Any) -> None:
    try:
        wrapper_prepare_request(tree_cache.linker, req)
    except Exception:
        # A failed preparation is a miss; the request recomputes.
        logger.exception("KVCR preparation failed for %s; it will recompute", req.rid)


# ---- scheduler hooks --------------------------------------------------------


def _after_add_request_to_queue(
    result: Any, scheduler: Any, req: Any, is_retracted: bool = False
) -> None:
    if preparing_linker_of(scheduler.tree_cache) is None:
        return
    queue = scheduler.waiting_queue
    bootstrap = getattr(scheduler, "disagg_prefill_bootstrap_queue", None)
    enqueued = bool(queue) and queue[-1] is req
    if not enqueued and bootstrap is not None:
        pending: list[Any] = getattr(bootstrap, "queue", None) or []
        enqueued = bool(pending) and pending[-1] is req
    if enqueued:
        _prepare_safely(scheduler.tree_cache, req)


def _after_optimistic_requeue(
    result: Any, scheduler: Any, *args: Any, **kw: Any
) -> None:
    """Prepare the request just requeued (its new attempt), wherever it went."""
    tree_cache = getattr(scheduler, "tree_cache", None)
    if tree_cache is None or preparing_linker_of(tree_cache) is None:
        return
    req = args[0] if args else kw.get("req")
    if req is not None:
        _prepare_safely(tree_cache, req)


def _around_get_new_batch_prefill(
    original: Callable[..., Any], scheduler: Any, *args: Any, **kwargs: Any
) -> Any:
    tree_cache = scheduler.tree_cache
    queue = scheduler.waiting_queue
    if not queue or preparing_linker_of(tree_cache) is None:
        return original(scheduler, *args, **kwargs)
    ready = wrapper_sync_preparation(tree_cache.linker, queue)
    linker_hook(tree_cache.linker.cache_linker, "note_admission")(
        [r.rid for r in queue], ready
    )
    if all(ready):
        return original(scheduler, *args, **kwargs)
    held = [r for r, ok in zip(queue, ready, strict=True) if not ok]
    scheduler.waiting_queue = [r for r, ok in zip(queue, ready, strict=True) if ok]
    try:
        return original(scheduler, *args, **kwargs)
    finally:
        scheduler.waiting_queue = merge_held(queue, held, scheduler.waiting_queue)


# ---- restore verdicts --------------------------------------------------------


def _around_finish_loads(original: Callable[..., Any], wrapper: Any) -> list[str]:
    """The wrapper's ``finish_loads`` with one verdict per request instead of one
    per batch: only requests whose own KV did not land are aborted; the others
    of the batch run on their restored KV. Each request's verdict is MIN-reduced
    across the attention group (same rids, same order on every rank)."""
    backend = wrapper.cache_linker
    by_request = getattr(backend, "finish_layer_wise_loading_by_request", None)
    if by_request is None:
        return original(wrapper)
    rids, wrapper.inflight_load_rids = wrapper.inflight_load_rids, []
    if not rids:
        return []
    index, wrapper.inflight_load_index = wrapper.inflight_load_index, -1
    verdicts = by_request(index)
    # Every rank must reduce as many flags: check the count first (MIN of n and
    # of -n), and abort them all if the ranks' lists ever differ.
    sizes = [len(rids), -len(rids)]
    if _min_across_ranks(wrapper.cache, sizes) != sizes:
        logger.error("KVCR restore verdicts: ranks disagree on the loading requests")
        landed = [0] * len(rids)
    else:
        # A request the linker has no record of did not land (fail closed).
        landed = [int(verdicts.get(rid, False)) for rid in rids]
        landed = _min_across_ranks(wrapper.cache, landed)
    for rid in rids:
        wrapper.private_load_indices.pop(rid, None)
    failed = [rid for rid, ok in zip(rids, landed, strict=True) if not ok]
    if failed:
        logger.error(
            "KVCR restore did not land for %d of %d request(s); aborting %s",
            len(failed),
            len(rids),
            failed,
        )
    return failed


# ---- release hooks ----------------------------------------------------------


def _after_wrapper_release_request(result: Any, wrapper: Any, rid: str) -> None:
    linker_hook(wrapper.cache_linker, "release_request")(rid)


def _after_on_release(result: Any, cache: Any, req: Any, **kwargs: Any) -> None:
    backend = cache_linker_of(cache)
    if backend is not None:
        linker_hook(backend, "finish_request")(req.rid)


# ---- events and stored marks --------------------------------------------------


def _after_init_cache_linker(result: Any, cache: Any, cache_linker: Any) -> None:
    if not (
        linker_hook(cache_linker, "prepares_requests")
        or linker_hook(cache_linker, "publishes_external_events")
    ):
        return
    require_hooks_installed()
    linker_hook(cache_linker, "lookup_groups")(len(stored_marks.reduce_groups(cache)))
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

    if not isinstance(cache.tree_core, UnifiedTreeCore):
        raise KVCRUnavailableError(
            f"the KVCR linker needs SGLang's Python radix tree core (got "
            f"{type(cache.tree_core).__name__}); set {TREE_CORE_ENV}=python"
        )


def _after_cache_reset(result: Any, cache: Any) -> None:
    # A flush rebuilt KVCR empty: nothing indexed is stored externally any more.
    stored = stored_marks.stored_pages(cache_linker_of(cache))
    if stored is not None:
        stored.reset()


def _around_commit_completed_offloads(
    original: Callable[..., Any], wrapper: Any, successes: Iterable[bool]
) -> Any:
    backend = wrapper.cache_linker
    if not linker_hook(backend, "publishes_external_events"):
        return original(wrapper, successes)
    successes = list(successes)
    published = [p.publish_node_ids for p in wrapper.pending_offloads[: len(successes)]]
    result = original(wrapper, successes)
    core = wrapper.cache.tree_core
    stored = stored_marks.stored_pages(backend)
    evicted: list[str] = []
    for ok, node_ids in zip(successes, published, strict=True):
        if not ok:
            continue
        for node_id in node_ids:
            node = stored_marks.node_or_none(core, node_id)
            if node is not None:
                evicted += stored_marks.committed(core, node, stored)
    if evicted:
        stored_marks.clear_stored_marks(wrapper.cache, evicted)
    return result


def _around_on_idle(
    original: Callable[..., Any], scheduler: Any, *args: Any, **kw: Any
) -> Any:
    """No batch this pass. Fully idle (nothing waiting), a preparing linker may
    first block briefly for its own work (``scheduler_idle``), told whether the
    idle poll then blocks (``--sleep-on-idle``, Rust server: up to 1 s) and how to
    ask whether SGLang holds session requests (``session_pins``)."""
    backend = preparing_linker_of(getattr(scheduler, "tree_cache", None))
    if backend is not None and scheduler.is_fully_idle():
        sargs = getattr(scheduler, "server_args", None)
        sleeps = getattr(sargs, "sleep_on_idle", False) or envs.SGLANG_RUST_SERVER.get()
        linker_hook(backend, "scheduler_idle")(
            sleeps=bool(sleeps), holds_sessions=lambda: holds_sessions(scheduler)
        )
    return original(scheduler, *args, **kw)


def _around_process_batch_result(
    original: Callable[..., Any], scheduler: Any, *args: Any, **kw: Any
) -> Any:
    """A batch's result: its write-through offloads are made inside it, and
    the linker counts it once it is processed, its output streamed
    (``batch_result_started`` / ``batch_done``)."""
    backend = preparing_linker_of(getattr(scheduler, "tree_cache", None))
    if backend is None:
        return original(scheduler, *args, **kw)
    linker_hook(backend, "batch_result_started")()
    try:
        return original(scheduler, *args, **kw)
    finally:
        linker_hook(backend, "batch_done")()


def _after_check_hicache_events(result: Any, cache: Any) -> None:
    backend = cache_linker_of(cache)
    if backend is None or not linker_hook(backend, "publishes_external_events"):
        return
    removed = linker_hook(backend, "take_removed_page_hashes")()
    union = stored_marks.gather_union(cache, removed)
    if union:
        stored_marks.clear_stored_marks(cache, union)


def nccl_group_over(group: Any) -> Any:
    """SGLang's NCCL group over ``group``'s ranks (collective over the world)."""
    from sglang.srt.distributed import parallel_state

    ranks = list(torch.distributed.get_process_group_ranks(group))
    return parallel_state.create_custom_parallel_group(ranks, backend="nccl")


# Every hooked SGLang target, in registration order.
TARGETS: tuple[str, ...] = tuple(target for target, _, _ in _hooks())
