"""The failed restore copy: a real UnifiedRadixCache, the plugin's wrapper, and a
restore destination that raises on one layer.

``Stack`` is ``cpu_harness.kvcr_stack``'s production-built cache and linker with
the scheduler steps this scenario needs (insert and commit, evict, enqueue a
request as the scheduler does, load back).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch

from cpu_harness import kvcr_stack
from cpu_harness.kvcr_pages import (
    DIM,
    HEADS,
    LAYERS,
    PAGE,
    POOL_PAGES,
    buffers,
    fill_random,
    wait_until,
)
from kvcr_drivers.faults.common import (
    BASE_CONFIG,
    WAIT_S,
    Harness,
    Scenario,
    ctx,
    settle,
)
from sglang.srt.mem_cache.storage.kvcr.datapath import row_team
from sglang.srt.mem_cache.storage.kvcr.datapath.restore_copy import CpuRestorePlan
from sglang.srt.mem_cache.storage.kvcr.datapath.row_team import RowTeam


class InjectedCopyFault(Exception):
    """The fault injected into one layer's restore copy."""


def scenario_failed_device_copy_mid_layer(sc: Scenario) -> None:
    """The restore copy raises on layer 1 (real UnifiedRadixCache + wrapper) while
    the other layers' pieces copy: the batch's load reports failure, SGLang
    aborts exactly that request with its reason, layer 1 is never written and nothing enters the tree, claims are
    released, and the linker stops restoring (later requests are clean misses)."""
    stack = build_stack()
    h = Harness(sc)
    h.linkers.append(stack.linker)
    cache, linker, kvcache = stack.cache, stack.linker, stack.kvcache
    prefix = list(range(100, 100 + 3 * PAGE))
    stack.insert_and_commit(prefix, seed=31)
    stack.evict(prefix)
    for buf in buffers(kvcache):
        buf.zero_()
    pool = linker.layout.pools[0]
    layer1 = set(pool.layer_part_indices(1))
    make_piece = CpuRestorePlan.piece
    # Pieces of one row (one span of one page), copied by the scheduler thread
    # and a helper whatever this host's thread count.
    if linker.restorer.team is not None:
        linker.restorer.team.close(WAIT_S)
    linker.restorer.team = RowTeam(1, "copy-fault-rows")

    def failing_piece(
        plan: CpuRestorePlan, dst: Any, index: Any, values: Any, lo: int, hi: int
    ) -> Any:
        """A piece of the CPU restore: raises, before writing, when its span
        range holds part of layer 1 (the other pieces copy)."""
        if layer1 & set(range(lo, hi)):

            def fail() -> None:
                raise InjectedCopyFault("injected device copy fault on layer 1")

            return fail
        return make_piece(plan, dst, index, values, lo, hi)

    def admit(rid: str) -> Any:
        req = stack.make_req(rid, [*prefix, 7, 8])
        stack.enqueue(req)
        wait_until(lambda: linker.preparation_ready(stack.handle_of(req)), WAIT_S, rid)
        req.init_next_round_input(cache)
        return req

    req = admit("copy-fault")
    sc.check("the prefix is an external hit", req.host_hit_length == len(prefix))
    stack.load_back(req)
    private = cache.linker.private_load_indices[req.rid].clone()
    CpuRestorePlan.piece = failing_piece  # type: ignore[method-assign]
    piece_bytes, row_team.PIECE_BYTES = row_team.PIECE_BYTES, 1
    try:
        sc.check("the load batch starts", cache.ready_to_load_host_cache() >= 0)
        failed = cache.finish_external_linker_loads([req])
    finally:
        CpuRestorePlan.piece = make_piece  # type: ignore[method-assign]
        row_team.PIECE_BYTES = piece_bytes
    reason = getattr(req.discard_output_reason, "message", None) or str(
        req.discard_output_reason
    )
    sc.check(
        "the failed request is reported", [r.rid for r in failed] == ["copy-fault"]
    )
    sc.check(
        "its output is discarded with a reason", req.discard_output_reason is not None
    )
    sc.check("its KV never enters the radix tree", req.skip_radix_cache_insert is True)
    layer1 = torch.cat(
        [
            buf[private].reshape(-1).view(torch.uint8)
            for buf in (kvcache.k_buffer[1], kvcache.v_buffer[1])
        ]
    )
    sc.check("layer 1 was never written", not layer1.any())
    layer0 = torch.cat(
        [
            buf[private].reshape(-1).view(torch.uint8)
            for buf in (kvcache.k_buffer[0], kvcache.v_buffer[0])
        ]
    )
    sc.check("the other pieces copied (layer 0 landed)", bool(layer0.any()))
    cache.on_release(req, checkpointed=False)
    sc.check("claims released after the failed copy", settle(linker) == (0, 0))
    sc.check("the loader thread survived", linker.restorer.thread.is_alive())
    disabled = linker.stats.miss_restore_disabled
    req2 = admit("after-fault")
    sc.check(
        "later requests are clean misses (restores stopped)", req2.host_hit_length == 0
    )
    sc.check(
        "counted as restore_disabled", linker.stats.miss_restore_disabled > disabled
    )
    cache.on_release(req2, checkpointed=False)
    sc.output_matches_control = (
        bool(failed) and not layer1.any() and req2.host_hit_length == 0
    )
    sc.outcome = f"aborted with {reason!r}; later requests recompute"
    h.finish()


@dataclasses.dataclass
class Stack:
    cache: Any
    kvcache: Any
    allocator: Any
    linker: Any

    def insert_and_commit(
        self, tokens: list[int], seed: int
    ) -> tuple[Any, torch.Tensor]:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        slots = self.allocator.alloc(len(tokens))
        fill_random(self.kvcache, slots, seed, page=1)
        original = torch.cat(
            [b[slots].reshape(-1).view(torch.uint8) for b in buffers(self.kvcache)]
        ).clone()
        self.cache.insert(InsertParams(key=_radix_key(tokens), value=slots))

        def committed() -> bool:
            self.cache.check_hicache_events()
            return not self.cache.linker.pending_offloads

        wait_until(committed, WAIT_S, "offloads committed")
        return slots, original

    def evict(self, tokens: list[int]) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            MatchPrefixParams,
        )

        self.cache.evict(EvictParams(num_tokens=len(tokens)))
        match = self.cache.match_prefix(MatchPrefixParams(key=_radix_key(tokens)))
        assert match.device_prefix_len == 0

    @staticmethod
    def make_req(rid: str, tokens: list[int]) -> Any:
        from array import array

        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        return Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=1))

    def enqueue(self, req: Any) -> None:
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.scheduler import Scheduler

        sched = SimpleNamespace(
            tree_cache=self.cache,
            waiting_queue=[],
            disaggregation_mode=DisaggregationMode.NULL,
            processed_tokens_counter=0,
            _set_or_validate_priority=lambda r: True,
            _abort_on_queued_limit=lambda r: False,
            _prefetch_kvcache=lambda r: None,
        )
        Scheduler._add_request_to_queue(sched, req)

    @staticmethod
    def handle_of(req: Any) -> str:
        return ctx(req.rid, attempt=req.cache_request_handle.attempt_id).handle

    def load_back(self, req: Any) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        self.cache.init_load_back(
            InitLoadBackParams(
                best_match_node=req.best_match_node,
                host_hit_length=req.host_hit_length,
                req=req,
            )
        )


def _radix_key(tokens: list[int]) -> Any:
    from array import array

    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens))


def build_stack(**cfg: Any) -> Stack:
    """A real pool, allocator, UnifiedRadixCache (Python tree core) and a linker made
    the production way (``create_unified_cache_linker(backend="kvcr")``)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()  # before the factory is used: the plugin wraps it
    config = {**BASE_CONFIG, "preparation_timeout_ms": 10_000, **cfg}
    s = kvcr_stack.build_stack(
        config, kvcr_stack.Geometry(PAGE, LAYERS, HEADS, DIM, POOL_PAGES * PAGE)
    )
    return Stack(s.cache, s.kvcache, s.allocator, s.linker)
