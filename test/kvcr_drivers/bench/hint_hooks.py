"""Preparation named by a ``kv.fetch`` hint to a peer linker, and (d) the scheduler
hooks' overhead over a real UnifiedRadixCache with an idle linker."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from array import array
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from cpu_harness.kvcr_pages import fetch_hint, fill_random, make_linker
from kvcr_drivers.bench.metrics import (
    dist,
    gbps,
    metric,
    random_hashes,
    settle,
    thread_cpu_pct,
)
from kvcr_drivers.bench.pools import (
    MIB,
    Geometry,
    kv_transfer,
    linker_args,
    make_pool,
    offload_once,
    prepare_and_lookup,
)


def bench_hint(
    args: argparse.Namespace, out: dict[str, Any], metrics: list[dict[str, Any]]
) -> None:
    """B prepares pages only A holds, told by a kv.fetch hint naming A."""
    rng = random.Random(args.seed + 1)
    geo = Geometry(args.hint_layers, args.heads, args.head_dim, args.page_size)
    n = args.request_pages
    pool_a, pool_b = make_pool(geo, 3 + 2 * n), make_pool(geo, 3 + n)
    a = make_linker(pool_a, **linker_args(geo, 2 * n))
    # B holds exactly one request: alternating two prompts evicts the other, so
    # every sample's pages are remote.
    b = make_linker(pool_b, **linker_args(geo, n))
    try:
        prompts = []
        for j in range(2):
            pages = list(range(1 + j * n, 1 + (j + 1) * n))
            fill_random(pool_a, pages, seed=10 + j, page=geo.page)
            hashes = random_hashes(rng, n)
            offload_once(a, geo, hashes, pages)
            hint = fetch_hint(a.endpoint, hashes)
            prompts.append((kv_transfer(geo, hashes), hint))
        total_us, call_us, short = [], [], 0
        settle()
        for i in range(args.samples + 10):
            transfers, hint = prompts[i % 2]
            total, calls, hit, _ = prepare_and_lookup(b, f"p{i}", transfers, hint)
            short += hit != n
            b.release_request(f"p{i}")
            if i >= 10:
                total_us.append(total * 1e6)
                call_us.append(calls * 1e6)
        remote_fetched = b.stats.prepared_pages
        out["hint"] = {
            "geometry": vars(geo) | {"request_bytes": n * geo.page_bytes},
            "us": dist(total_us),
            "scheduler_call_us": dist(call_us),
            "short_lookups": short,
            "prepared_pages": remote_fetched,
            "peer_gbps_p50": round(
                gbps(n * geo.page_bytes, statistics.median(total_us) / 1e6), 3
            ),
        }
        metrics.append(
            metric(
                "hint_prepare_us_p50",
                statistics.median(total_us),
                "us",
                samples=len(total_us),
                scheduler_call_us_p50=out["hint"]["scheduler_call_us"]["p50"],
                short_lookups=short,
                note=f"{args.hint_layers}-layer peer pair; each sample pulls "
                f"{n * geo.page_bytes / MIB:.1f} MiB from the peer",
            )
        )
    finally:
        b.close()
        a.close()


# ---- (d) scheduler hook overhead over a real cache ---------------------------------


def bench_hooks(
    args: argparse.Namespace, out: dict[str, Any], metrics: list[dict[str, Any]]
) -> None:
    import torch
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache import linker_factory
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.plugins import load_plugins
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import integration

    load_plugins()
    page = args.page_size
    prompt_len = args.request_pages * page - page // 2  # e.g. 2976 at page 64
    pool_tokens = 4 * args.request_pages * page
    config = {
        "local_dram_bytes_per_worker": 64 * MIB,
        "operation_timeout_ms": 10000,
        "abandon_timeout_ms": 20000,
    }

    def build(with_linker: bool) -> tuple[Any, Any]:
        server_args = ServerArgs(
            model_path="dummy",
            page_size=page,
            device="cpu",
            **(
                {
                    "enable_unified_cache_external_linker": True,
                    "unified_cache_external_linker_backend": "kvcr",
                    "unified_cache_external_linker_config": config,
                }
                if with_linker
                else {}
            ),
        )
        set_global_server_args_for_scheduler(server_args)
        kvcache = MHATokenToKVPool(
            pool_tokens, page, torch.bfloat16, 2, 8, 2, "cpu", False
        )
        allocator = PagedTokenToKVPoolAllocator(
            pool_tokens, page, torch.bfloat16, "cpu", kvcache, False
        )
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=ReqToTokenPool(8, prompt_len + 64, "cpu", False),
            token_to_kv_pool_allocator=allocator,
            page_size=page,
            tree_components=(ComponentType.FULL,),
            tree_core_backend="python",
        )
        cache = UnifiedRadixCache(params)
        linker = None
        if with_linker:
            # Through the module: load_plugins() wrapped the attribute.
            linker = linker_factory.create_unified_cache_linker(
                server_args,
                params,
                backend="kvcr",
                config=dict(config),
                components=set(cache.components),
            )
            cache.init_cache_linker(linker)
            kvcache.register_layer_transfer_counter(linker.layer_done_counter)
        from sglang.srt.disaggregation.utils import DisaggregationMode

        sched = SimpleNamespace(
            tree_cache=cache,
            waiting_queue=[],
            disaggregation_mode=DisaggregationMode.NULL,
        )
        return sched, linker

    plain, _ = build(False)
    linked, linker = build(True)
    rng = random.Random(args.seed + 2)
    count = args.samples + 20

    def requests_for(tag: str) -> Iterator[Any]:
        for i in range(count):
            tokens = array("q", (rng.randrange(3, 30000) for _ in range(prompt_len)))
            yield Req(f"{tag}{i}", "", tokens, SamplingParams(max_new_tokens=1))

    def original(scheduler: Any, *a: Any, **k: Any) -> None:
        return None

    def one(sched: Any, req: Any) -> float:
        sched.waiting_queue.append(req)
        t0 = time.perf_counter()
        integration._after_add_request_to_queue(None, sched, req)
        integration._around_get_new_batch_prefill(original, sched)
        elapsed = time.perf_counter() - t0
        sched.waiting_queue.clear()
        return elapsed

    try:
        # What an idle linker costs in the background (KVCR's progress loop and
        # the adapter's owner thread poll): taken from a CPU-bound forward pass.
        idle = thread_cpu_pct(5.0)
        kvcr_threads = {k: v for k, v in idle.items() if k.startswith("kvcr")}
        metrics.append(
            metric(
                "linker_idle_cpu_pct",
                sum(kvcr_threads.values()),
                "% core",
                threads=kvcr_threads,
            )
        )
        reqs_plain = list(requests_for("n"))
        reqs_linked = list(requests_for("k"))
        with_us, without_us = [], []
        settle()
        for i in range(count):  # interleaved, so drift hits both alike
            w = one(linked, reqs_linked[i])
            linker.release_request(reqs_linked[i].rid)
            wo = one(plain, reqs_plain[i])
            if i >= 20:
                with_us.append(w * 1e6)
                without_us.append(wo * 1e6)
        stats = linker.stats
        out["hooks"] = {
            "prompt_tokens": prompt_len,
            "with_linker_us": dist(with_us),
            "without_linker_us": dist(without_us),
            "linker_prepared": stats.prepared,
            "kvcr_fetches": linker._adapter.stats().fetches,
        }
        if stats.prepared:
            raise RuntimeError("the idle linker prepared pages for unique prompts")
        metrics.append(
            metric(
                "hook_overhead_us_p50",
                statistics.median(with_us),
                "us",
                statistics.median(without_us),
                samples=len(with_us),
            )
        )
    finally:
        linker.close()
