"""Two attention ranks over gloo on CPU: KVCR readiness and offload results stay in step.

Two spawned processes each build a real ``UnifiedRadixCache`` (Python tree core)
over a real CPU ``MHATokenToKVPool`` whose cache groups are a two-rank gloo group,
and attach their own real ``KVCRDirectLinker`` (each rank its own KVCR) through the
plugin's ``kvcr`` backend. The ranks then run the same steps in lockstep:

(a) readiness: rank 1 alone reports one request not ready; the MIN reduction gives
    both ranks the same verdict list, and the prefill gate hides that request on
    both ranks (neither admits it);
(b) offloads: rank 1 refuses a multi-page offload (its staging area holds one
    page only); both ranks still commit the same number of results in the same
    order, the node ends up not stored on both (MIN of success), and a later
    one-page offload that succeeds on both ranks is committed as stored on both.

The two processes run once per module; each test checks one part of what they
returned.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from cpu_harness import gloo_ranks

pytestmark = pytest.mark.kvcr

WORLD = 2
PAGE = 4
LAYERS = 2
HEADS = 2
DIM = 8
POOL_TOKENS = 64 * PAGE
# One page of K and V for every layer in bf16: what one page's deposit charges.
PAGE_DEPOSIT_BYTES = LAYERS * 2 * PAGE * HEADS * DIM * 2
JOB_TIMEOUT_S = 120.0
GLOO_TIMEOUT_S = 60
MAX_EVENT_ROUNDS = 4000  # a round bound, not a time bound: identical on both ranks
FIRST_PAGES = 4
REFUSING_RANK = 1
NOT_READY_RID = "r1"


def _linker_config(rank: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "local_dram_bytes_per_worker": 32 * PAGE_DEPOSIT_BYTES,
        "operation_timeout_ms": 5000,
        "abandon_timeout_ms": 10000,
        "preparation_timeout_ms": 2000,
    }
    if rank == REFUSING_RANK:
        # Staged offloads with one page of staging: a multi-page offload finds
        # the staging area too small (refused, reported as a failed offload); a
        # one-page offload fits. (The in-flight byte budget alone would admit an
        # oversized deposit when nothing else is in flight.)
        config["max_inflight_offload_bytes"] = PAGE_DEPOSIT_BYTES
        config["offload_path"] = "staged"
    return config


# ---- child process -----------------------------------------------------------------


def _run_rank(rank: int, port: int) -> dict[str, Any]:
    started = time.monotonic()
    timings: dict[str, float] = {}

    def mark(what: str) -> None:
        timings[what] = round(time.monotonic() - started, 2)

    import torch.distributed as dist
    from sglang.srt.plugins import load_plugins

    load_plugins()
    mark("imported")
    gloo_ranks.init_gloo(rank, port, WORLD, GLOO_TIMEOUT_S)
    cache = None
    try:
        group = dist.group.WORLD
        mark("gloo_up")
        cache, pool, allocator = _build_cache(rank, group)
        mark("built")
        out: dict[str, Any] = {
            "timings": timings,
            "tree_core": type(cache.tree_core).__name__,
            "linker": type(cache.linker.cache_linker).__name__,
            # Bound on a real two-rank group: lookups report every length.
            "lookups_reduced": cache.linker.cache_linker._lookups_reduced,
            "deposit_bytes": sum(
                p.page_bytes * len(p.part_labels)
                for p in cache.linker.cache_linker.layout.pools
            ),
        }
        out["readiness"] = _readiness_scenario(rank, cache)
        dist.barrier()
        mark("readiness")
        out["offloads"] = _offload_scenario(rank, cache, pool, allocator)
        dist.barrier()
        mark("offloads")
        out["removals"] = _removal_scenario(rank, cache)
        dist.barrier()
        return out
    finally:
        if cache is not None and cache.linker is not None:
            cache.linker.close()
        dist.destroy_process_group()


def _build_cache(rank: int, group: Any) -> tuple[Any, Any, Any]:
    from cpu_harness import kvcr_stack

    stack = kvcr_stack.build_stack(
        _linker_config(rank),
        kvcr_stack.Geometry(PAGE, LAYERS, HEADS, DIM, POOL_TOKENS),
        group=group,
    )
    return stack.cache, stack.kvcache, stack.allocator


def _removal_scenario(rank: int, cache: Any) -> dict[str, Any]:
    """Steps in which only rank 1 (or nobody) has evictions to announce: the
    union is the same on both ranks, and the object gather runs only when some
    rank has something."""
    from unittest import mock

    import torch.distributed as dist

    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import stored_marks

    real_gather = dist.all_gather_object
    gathers: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        gathers.append(1)
        return real_gather(*args, **kwargs)

    steps = [[], ["h-b", "h-a"] if rank == 1 else [], [], ["h-c"] if rank == 0 else []]
    unions, calls = [], []
    with mock.patch.object(dist, "all_gather_object", side_effect=counted):
        for removed in steps:
            before = len(gathers)
            unions.append(stored_marks.gather_union(cache, removed))
            calls.append(len(gathers) - before)
    return {"unions": unions, "gathers": calls}


class _Req:
    """The fields the readiness gate reads from a request."""

    def __init__(self, rid: str) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        self.rid = rid
        self.cache_request_handle = CacheRequestHandle(rid=rid, attempt_id=0)


class _Scheduler:
    """The two attributes ``_around_get_new_batch_prefill`` touches."""

    def __init__(self, tree_cache: Any, waiting_queue: list[Any]) -> None:
        self.tree_cache = tree_cache
        self.waiting_queue = waiting_queue


def _readiness_scenario(rank: int, cache: Any) -> dict[str, Any]:
    from unittest import mock

    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import integration

    linker = cache.linker.cache_linker
    reqs = [_Req(rid) for rid in ("r0", NOT_READY_RID, "r2")]
    real_ready = linker.preparation_ready
    local_calls: list[str] = []

    def ready(handle: Any) -> bool:
        local_calls.append(str(handle))
        if rank == REFUSING_RANK and str(handle).startswith(f"{NOT_READY_RID}#"):
            return False
        return bool(real_ready(handle))

    seen: list[list[str]] = []
    arrival = _Req("r3")

    def fake_original(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append([r.rid for r in scheduler.waiting_queue])
        # Admit the first visible request; a request arrives during the pass.
        admitted = scheduler.waiting_queue[0]
        scheduler.waiting_queue = [
            r for r in scheduler.waiting_queue if r is not admitted
        ] + [arrival]
        return ("batch", admitted.rid, args, kwargs)

    with mock.patch.object(linker, "preparation_ready", side_effect=ready):
        local = [bool(ready(_handle_of(r))) for r in reqs]
        local_calls.clear()
        verdicts = integration.wrapper_sync_preparation(cache.linker, reqs)
        sync_calls = list(local_calls)
        scheduler = _Scheduler(cache, list(reqs))
        result = integration._around_get_new_batch_prefill(
            fake_original, scheduler, "pass", running_batch=None
        )
    return {
        "local": local,
        "verdicts": verdicts,
        "sync_calls": sync_calls,
        "seen": seen,
        "result": [result[0], result[1], list(result[2]), result[3]],
        "queue_after": [r.rid for r in scheduler.waiting_queue],
        # The restore verdicts' MIN: rank r offers r, both get the smaller.
        "min": integration._min_across_ranks(cache, [rank, 7]),
    }


def _handle_of(req: Any) -> Any:
    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
        PreparationHandle,
    )

    return PreparationHandle(req.rid, req.cache_request_handle.attempt_id)


def _insert(cache: Any, tokens: list[int], value: Any) -> None:
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=value))


def _path(cache: Any, tokens: list[int]) -> list[dict[str, Any]]:
    """Root-to-leaf nodes of ``tokens``: length, stored mark, pending offload."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    result = cache.match_prefix(
        MatchPrefixParams(key=RadixKey(array("q", tokens)), req=None)
    )
    core = cache.tree_core
    node = core.node_by_id(result.last_device_node)
    path = []
    while node is not None and node is not core.root_node:
        path.append(
            {
                "len": len(node.key),
                "stored": bool(node.external_cache_stored),
                "pending": node.write_through_pending_id is not None,
            }
        )
        node = node.parent
    return list(reversed(path))


def _drain(cache: Any) -> int:
    """check_hicache_events in lockstep until every pending offload committed.

    Both ranks pop the same (MIN-reduced) count each round, so both see the same
    pending length and leave the loop in the same round.
    """
    rounds = 0
    while cache.linker.pending_offloads and rounds < MAX_EVENT_ROUNDS:
        cache.check_hicache_events()
        rounds += 1
        time.sleep(0.005)
    return rounds


def _offload_scenario(
    rank: int, cache: Any, pool: Any, allocator: Any
) -> dict[str, Any]:
    import torch

    from cpu_harness.kvcr_pages import fill_random

    linker = cache.linker.cache_linker
    out: dict[str, Any] = {}
    committed: list[list[bool]] = []
    original_commit = cache.linker.commit_completed_offloads

    def record_commit(successes: Any) -> Any:
        committed.append([bool(s) for s in successes])
        return original_commit(successes)

    cache.linker.commit_completed_offloads = record_commit
    local_results: list[bool] = []
    original_take = cache.linker.take_completed_offloads

    def record_take(n: int) -> list[bool]:
        taken = original_take(n)
        local_results.extend(bool(x) for x in taken)
        return taken

    cache.linker.take_completed_offloads = record_take
    try:
        # Phase 1: a four-page node; rank 1's deposit is over its budget.
        first = list(range(1000, 1000 + FIRST_PAGES * PAGE))
        first_value = allocator.alloc(len(first))
        fill_random(pool, first_value, 1000 * rank + 1, page=1)
        _insert(cache, first, first_value)
        out["pending_after_first_insert"] = len(cache.linker.pending_offloads)
        out["first_rounds"] = _drain(cache)
        out["first_local"] = list(local_results)
        out["first_committed"] = [list(c) for c in committed]
        out["first_path"] = _path(cache, first)
        out["pending_after_first"] = len(cache.linker.pending_offloads)
        out["refused_after_first"] = (
            linker._adapter.stats().refused_offload + linker.stats.offload_staging_full
        )
        out["failures_after_first"] = linker.stats.offload_failures

        # Phase 2: extend by one page; the chain re-offloads the unstored
        # four-page ancestor (refused again on rank 1) and the new one-page node
        # (fits everywhere).
        local_results.clear()
        committed.clear()
        second = first + list(range(5000, 5000 + PAGE))
        tail_value = allocator.alloc(PAGE)
        fill_random(pool, tail_value, 1000 * rank + 2, page=1)
        _insert(cache, second, torch.cat([first_value, tail_value]))
        out["pending_after_second_insert"] = len(cache.linker.pending_offloads)
        out["second_rounds"] = _drain(cache)
        out["second_local"] = list(local_results)
        out["second_committed"] = [list(c) for c in committed]
        out["second_path"] = _path(cache, second)
        out["pending_after_second"] = len(cache.linker.pending_offloads)
        out["linker_fifo_after"] = len(linker.offloader.queue)
        out["refused_after_second"] = (
            linker._adapter.stats().refused_offload + linker.stats.offload_staging_full
        )
        out["failures_after_second"] = linker.stats.offload_failures
    finally:
        del cache.linker.commit_completed_offloads
        del cache.linker.take_completed_offloads
    return out


# ---- parent ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks() -> dict[int, dict[str, Any]]:
    return gloo_ranks.run_ranks(_run_rank, WORLD, timeout_s=JOB_TIMEOUT_S)


# ---- tests -------------------------------------------------------------------------


def test_each_rank_runs_its_own_kvcr_linker_on_the_python_tree_core(ranks):
    """Both ranks built the plugin's linker over a real cache and CPU pool."""
    for rank in range(WORLD):
        print(f"rank {rank} timings (s since spawn): {ranks[rank]['timings']}")
        assert ranks[rank]["tree_core"] == "UnifiedTreeCore"
        assert ranks[rank]["linker"] == "KVCRDirectLinker"
        # The ranks' MIN intersects every restorable length each reports.
        assert ranks[rank]["lookups_reduced"] is True
        # The refusing rank's budget is exactly one page's deposit.
        assert ranks[rank]["deposit_bytes"] == PAGE_DEPOSIT_BYTES


def test_readiness_is_min_reduced_and_both_ranks_hold_the_same_request(ranks):
    """Rank 1 alone says r1 is not ready; neither rank admits r1."""
    r0, r1 = ranks[0]["readiness"], ranks[1]["readiness"]
    assert r0["local"] == [True, True, True]
    assert r1["local"] == [True, False, True]
    # Every request was polled locally, in queue order, before the reduction.
    assert r0["sync_calls"] == r1["sync_calls"] == ["r0#0", "r1#0", "r2#0"]
    assert r0["verdicts"] == r1["verdicts"] == [True, False, True]
    # The prefill pass saw the same queue on both ranks, without r1.
    assert r0["seen"] == r1["seen"] == [["r0", "r2"]]
    # The original's result passes through with its arguments.
    assert (
        r0["result"]
        == r1["result"]
        == ["batch", "r0", ["pass"], {"running_batch": None}]
    )
    # r0 was admitted; r1 is back in its place; the arrival goes last.
    assert r0["queue_after"] == r1["queue_after"] == ["r1", "r2", "r3"]
    assert r0["min"] == r1["min"] == [0, 7]


def test_refused_offload_on_one_rank_keeps_results_paired(ranks):
    """Rank 1's refused deposit: same commits on both ranks, node not stored."""
    o0, o1 = ranks[0]["offloads"], ranks[1]["offloads"]
    # The same offloads were accepted on both ranks (offload() always queues).
    assert o0["pending_after_first_insert"] == o1["pending_after_first_insert"] == 1
    # Local outcomes differ: rank 0 stored it, rank 1's KVCR budget refused it.
    assert o0["first_local"] == [True]
    assert o1["first_local"] == [False]
    assert o0["refused_after_first"] == 0 and o0["failures_after_first"] == 0
    assert o1["refused_after_first"] == 1  # refused before any deposit was made
    assert o1["failures_after_first"] == 0
    # The MIN-reduced verdict is committed identically, in the same rounds.
    assert o0["first_committed"] == o1["first_committed"] == [[False]]
    assert o0["first_rounds"] == o1["first_rounds"] < MAX_EVENT_ROUNDS
    expected = [{"len": FIRST_PAGES * PAGE, "stored": False, "pending": False}]
    assert o0["first_path"] == o1["first_path"] == expected
    assert o0["pending_after_first"] == o1["pending_after_first"] == 0


def test_later_offload_that_succeeds_everywhere_is_stored_on_both_ranks(ranks):
    """After the refusal the pairing is intact: a good offload commits as stored."""
    o0, o1 = ranks[0]["offloads"], ranks[1]["offloads"]
    # The write-through chain re-offloads the unstored ancestor, then the new node.
    assert o0["pending_after_second_insert"] == o1["pending_after_second_insert"] == 2
    assert o0["second_local"] == [True, True]
    assert o1["second_local"] == [False, True]  # the ancestor is still over budget
    assert o0["second_committed"] == o1["second_committed"]
    assert [s for batch in o0["second_committed"] for s in batch] == [False, True]
    assert o0["second_rounds"] == o1["second_rounds"] < MAX_EVENT_ROUNDS
    expected = [
        {"len": FIRST_PAGES * PAGE, "stored": False, "pending": False},
        {"len": PAGE, "stored": True, "pending": False},
    ]
    assert o0["second_path"] == o1["second_path"] == expected
    # Nothing left over on either side of the positional pairing.
    assert o0["pending_after_second"] == o1["pending_after_second"] == 0
    assert o0["linker_fifo_after"] == o1["linker_fifo_after"] == 0
    assert o1["refused_after_second"] == 2 and o1["failures_after_second"] == 0
    assert o0["refused_after_second"] == 0 and o0["failures_after_second"] == 0


def test_removed_hashes_are_gathered_only_in_steps_where_some_rank_has_any(ranks):
    """Both ranks get the same union; steps with nothing removed skip the gather."""
    u0, u1 = ranks[0]["removals"], ranks[1]["removals"]
    assert u0["unions"] == u1["unions"] == [[], ["h-a", "h-b"], [], ["h-c"]]
    assert u0["gathers"] == u1["gathers"] == [0, 1, 0, 1]
