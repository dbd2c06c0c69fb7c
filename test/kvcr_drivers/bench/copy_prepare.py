"""(a) restore vs torch ``copy_``, (b) offload vs a raw NIXL loopback WRITE, and
(c) zero-hit / hit preparation latency, over one realistic CPU pool."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

from cpu_harness.kvcr_pages import fill_random, make_linker
from kvcr_drivers.bench.metrics import dist, gbps, metric, random_hashes, settle
from kvcr_drivers.bench.pools import (
    WAIT_S,
    Geometry,
    kv_transfer,
    linker_args,
    make_pool,
    offload_once,
    page_rows,
    pages_equal,
    prepare_and_lookup,
)


class NixlLoopback:
    """Raw NIXL DRAM loopback WRITE of ``n`` descriptors of ``size`` bytes."""

    def __init__(self, src: Any, dst: Any, size: int, n: int) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = f"bench-loopback-{os.getpid()}"
        self.agent = nixl_agent(
            self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        self.regs = self.agent.register_memory([src, dst])
        s, d = src.data_ptr(), dst.data_ptr()
        local = [(s + i * size, size, 0) for i in range(n)]
        remote = [(d + i * size, size, 0) for i in range(n)]
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
        self.remote = self.agent.prep_xfer_dlist(self.name, remote, "DRAM")
        self.indices = list(range(n))

    def write(self) -> float:
        handle = self.agent.make_prepped_xfer(
            "WRITE", self.local, self.indices, self.remote, self.indices
        )
        t0 = time.perf_counter()
        state = self.agent.transfer(handle)
        deadline = time.monotonic() + WAIT_S
        while state not in ("DONE", "ERR"):
            if time.monotonic() >= deadline:
                # Do not release or deregister memory a transfer may still touch.
                raise TimeoutError("NIXL loopback WRITE did not finish")
            state = self.agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - t0
        if state != "DONE":
            raise RuntimeError(f"NIXL loopback WRITE ended {state}")
        self.agent.release_xfer_handle(handle)
        return elapsed

    def close(self) -> None:
        self.agent.release_dlist_handle(self.local)
        self.agent.release_dlist_handle(self.remote)
        self.agent.deregister_memory(self.regs)


def bench_copy_and_prepare(
    args: argparse.Namespace, out: dict[str, Any], metrics: list[dict[str, Any]]
) -> None:
    import torch

    rng = random.Random(args.seed)
    geo = Geometry(args.layers, args.heads, args.head_dim, args.page_size)
    n = args.request_pages
    nbytes = n * geo.page_bytes
    src_pages = list(range(1, 1 + n))
    dst_contig = list(range(2 + n, 2 + 2 * n))
    # Half of a 2n-page range in random order: short runs, as after churn.
    dst_scattered = rng.sample(range(2 + n, 2 + 3 * n), n)
    pool = make_pool(geo, 3 + 3 * n)
    fill_random(pool, src_pages, seed=1, page=geo.page)
    linker = make_linker(pool, **linker_args(geo, 2 * n))
    details: dict[str, Any] = {
        "geometry": vars(geo) | {"request_pages": n, "request_bytes": nbytes},
        "torch_threads": torch.get_num_threads(),
    }
    out["copy"] = details
    try:
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        nixl = NixlLoopback(src, dst, geo.part_bytes, n * 2 * geo.layers)
        settle()
        # (b) offload vs NIXL loopback, interleaved; rep 0 warms both up.
        offload_s, nixl_s = [], []
        hashes = []
        for rep in range(args.copy_reps + 1):
            hashes = random_hashes(rng, n)
            o = offload_once(linker, geo, hashes, src_pages)
            w = nixl.write()
            if rep == 0:
                if not torch.equal(src, dst):
                    raise RuntimeError("NIXL loopback WRITE was not byte-exact")
                continue
            offload_s.append(o)
            nixl_s.append(w)
        nixl.close()
        off_gbps = [gbps(nbytes, s) for s in offload_s]
        nixl_gbps = [gbps(nbytes, s) for s in nixl_s]
        details["offload_gbps"] = [round(x, 3) for x in off_gbps]
        details["nixl_loopback_gbps"] = [round(x, 3) for x in nixl_gbps]
        details["nixl_descriptors"] = n * 2 * geo.layers
        metrics.append(
            metric(
                "offload_vs_nixl_loopback",
                statistics.median(off_gbps),
                "GB/s",
                statistics.median(nixl_gbps),
                samples=len(off_gbps),
            )
        )
        # (a) restore vs torch copy_, interleaved; the resident pages are the
        # last offload's.
        restore: dict[str, list[float]] = {"contiguous": [], "scattered": []}
        copy_s, index_copy_s = [], []
        rows = page_rows(pool, geo)
        dst_index = torch.tensor(dst_scattered, dtype=torch.long)
        src_rows = src.view(-1, geo.part_bytes).view(len(rows), n, geo.part_bytes)
        for rep in range(args.copy_reps + 1):
            for layout, dest in (
                ("contiguous", dst_contig),
                ("scattered", dst_scattered),
            ):
                dest_index = torch.tensor(dest, dtype=torch.long)
                for r in rows:
                    r.index_fill_(0, dest_index, 0)
                rid = f"restore-{layout}-{rep}"
                _, _, hit, _ = prepare_and_lookup(linker, rid, kv_transfer(geo, hashes))
                if hit != n:
                    raise RuntimeError(f"restore lookup hit {hit} of {n} pages")
                transfers = kv_transfer(geo, hashes, dest)
                t0 = time.perf_counter()
                linker.load(rid, transfers)
                index = linker.start_layer_wise_loading()
                ok = linker.finish_layer_wise_loading(index)
                elapsed = time.perf_counter() - t0
                linker.finish_request(rid)
                if not ok:
                    raise RuntimeError(f"restore failed: {linker.stats_line()}")
                if rep == 0:
                    if not pages_equal(pool, geo, src_pages, dest):
                        raise RuntimeError(f"restore ({layout}) was not byte-exact")
                    continue
                restore[layout].append(elapsed)
            t0 = time.perf_counter()
            dst.copy_(src)
            c = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i, r in enumerate(rows):
                r.index_copy_(0, dst_index, src_rows[i])
            ic = time.perf_counter() - t0
            if rep:
                copy_s.append(c)
                index_copy_s.append(ic)
        copy_gbps = statistics.median(gbps(nbytes, s) for s in copy_s)
        details["torch_copy_gbps"] = [round(gbps(nbytes, s), 3) for s in copy_s]
        details["torch_index_copy_gbps"] = [
            round(gbps(nbytes, s), 3) for s in index_copy_s
        ]
        for layout, times in restore.items():
            details[f"restore_{layout}_gbps"] = [
                round(gbps(nbytes, s), 3) for s in times
            ]
        # The headline is the worse destination layout of the two.
        worst = min(
            statistics.median(gbps(nbytes, s) for s in times)
            for times in restore.values()
        )
        metrics.append(
            metric(
                "restore_copy_vs_torch_copy",
                worst,
                "GB/s",
                copy_gbps,
                samples=args.copy_reps,
                torch_index_copy_gbps=round(
                    statistics.median(gbps(nbytes, s) for s in index_copy_s), 3
                ),
            )
        )
        del src, dst, src_rows
        settle()
        if "prepare" not in args.skip:
            bench_prepare(args, linker, geo, hashes, rng, out, metrics)
    finally:
        linker.close()


class _CountingAdapter:
    """Counts what the linker sends its adapter while installed."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.counts = {"submit": 0, "call": 0, "drain": 0}
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> _CountingAdapter:
        for name in self.counts:
            original = getattr(self.adapter, name)
            self._saved[name] = original

            def counted(*a: Any, _name: str = name, _f: Any = original, **k: Any):
                self.counts[_name] += 1
                return _f(*a, **k)

            setattr(self.adapter, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self._saved:
            delattr(self.adapter, name)


def bench_prepare(
    args: argparse.Namespace,
    linker: Any,
    geo: Geometry,
    resident: list[str],
    rng: random.Random,
    out: dict[str, Any],
    metrics: list[dict[str, Any]],
) -> None:
    n = args.request_pages
    details: dict[str, Any] = {}
    out["prepare"] = details
    zero_sets = [random_hashes(rng, n) for _ in range(args.samples + 20)]
    fetches_before = linker._adapter.stats().fetches
    zero_total, zero_not_ready = [], 0
    with _CountingAdapter(linker._adapter) as counter:
        settle()
        for i, hashes in enumerate(zero_sets):
            transfers = kv_transfer(geo, hashes)
            total, _, hit, waited = prepare_and_lookup(linker, f"z{i}", transfers)
            if hit or waited:
                zero_not_ready += 1
            if i >= 20:
                zero_total.append(total * 1e6)
            linker.release_request(f"z{i}")
        zero_counts = dict(counter.counts)
    details["zero_hit_us"] = dist(zero_total)
    details["zero_hit_adapter_calls"] = zero_counts
    details["zero_hit_not_ready_at_once"] = zero_not_ready
    details["zero_hit_kvcr_fetches"] = linker._adapter.stats().fetches - fetches_before
    owner_commands = (
        zero_counts["submit"] + zero_counts["call"] + details["zero_hit_kvcr_fetches"]
    )
    metrics += [
        metric(
            "zero_hit_prepare_us_p50",
            statistics.median(zero_total),
            "us",
            samples=len(zero_total),
            p90=details["zero_hit_us"]["p90"],
        ),
        metric(
            "zero_hit_owner_commands",
            owner_commands + zero_not_ready,
            "count",
            samples=len(zero_sets),
            note="owner-thread commands/calls/fetches plus requests not ready at "
            "once, over every zero-hit prepare+lookup (drain() reads the local "
            "result queue only and is counted separately)",
            drains=zero_counts["drain"],
        ),
    ]
    transfers = kv_transfer(geo, resident)
    hit_total, hit_calls, misses, held = [], [], 0, 0
    settle()
    for i in range(args.samples + 20):
        total, calls, hit, waited = prepare_and_lookup(linker, f"h{i}", transfers)
        misses += hit != n
        held += i >= 20 and bool(waited)
        linker.release_request(f"h{i}")
        if i >= 20:
            hit_total.append(total * 1e6)
            hit_calls.append(calls * 1e6)
    details["hit_us"] = dist(hit_total)
    details["hit_scheduler_call_us"] = dist(hit_calls)
    details["hit_short_lookups"] = misses
    metrics.append(
        metric(
            "hit_not_ready_at_once",
            held,
            "count",
            samples=len(hit_total),
            note="local hits not ready at their first preparation_ready (each "
            "would be held at least one scheduling pass)",
        )
    )
    metrics.append(
        metric(
            "hit_prepare_us_p50",
            statistics.median(hit_total),
            "us",
            error=f"{misses} lookups hit fewer than {n} pages" if misses else None,
            samples=len(hit_total),
            scheduler_call_us_p50=details["hit_scheduler_call_us"]["p50"],
        )
    )
