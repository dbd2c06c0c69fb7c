"""(f) restore and offload against plain host<->device copies, per request size,
on ``--device``: the offload is the linker's default path, one copy from the pool
into KVCR DRAM (``datapath/dram_copy.py``)."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from cpu_harness.kvcr_pages import fill_random, make_linker
from kvcr_drivers.bench.metrics import (
    gbps,
    metric,
    random_hashes,
    settle,
    target_of,
)
from kvcr_drivers.bench.pools import (
    OFFLOAD_POLL_S,
    Geometry,
    copy_once,
    host_bytes,
    linker_args,
    make_pool,
    offload_once,
    pages_equal,
    polled_copy_once,
    release_device_memory,
    restore_once,
    span_ms,
    zero_pages,
)


def transfer_case(
    args: argparse.Namespace, geo: Geometry, n: int, rng: random.Random
) -> dict[str, list[float]]:
    """Seconds per rep of: the offload of ``n`` scattered pool pages until its
    FIFO result; a device-to-host copy of the same bytes into (pinned) host
    memory, alone and on a side thread whose end is polled at the offload's
    pace (``polled_copy_once``); the restore of those pages from claimed KVCR
    DRAM into ``n`` other scattered pool pages; a host-to-device copy from a (pinned) host tensor.
    Interleaved rep by rep; rep 0 warms up and checks the restore byte for byte."""
    import torch

    device = args.device
    nbytes = n * geo.page_bytes
    order = rng.sample(range(1, 1 + 2 * n), 2 * n)
    src_pages, dst_pages = order[:n], order[n:]
    pool = make_pool(geo, 1 + 2 * n, device)
    fill_random(pool, src_pages, seed=7, page=geo.page)
    linker = make_linker(
        pool,
        **linker_args(
            geo,
            n + max(8, n // 4),
            max_inflight_offload_bytes=nbytes + geo.page_bytes,
        ),
    )
    host = host_bytes(nbytes, device)
    host.random_(0, 256)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    timelines: list[dict[str, Any]] = []
    restore_splits: list[dict[str, Any]] = []
    times: dict[str, Any] = {
        "offload": [],
        "d2h": [],
        "d2h_polled": [],
        "restore": [],
        "h2d": [],
    }
    try:
        settle()
        for rep in range(args.copy_reps + 1):
            hashes = random_hashes(rng, n)
            started = time.monotonic()
            got = {"offload": offload_once(linker, geo, hashes, src_pages, device)}
            if rep:
                timelines.append(
                    copy_timeline(linker.copier.recent, started, time.monotonic())
                )
            got["d2h"] = copy_once(host, dev, device)
            got["d2h_polled"] = polled_copy_once(host, dev, device, OFFLOAD_POLL_S)
            if rep == 0:
                zero_pages(pool, geo, dst_pages)
            got["restore"] = restore_once(
                linker,
                geo,
                f"t{n}-{rep}",
                hashes,
                dst_pages,
                device,
                restore_splits if rep else None,
            )
            if rep == 0 and not pages_equal(pool, geo, src_pages, dst_pages):
                raise RuntimeError(f"{n}-page restore was not byte-exact")
            got["h2d"] = copy_once(dev, host, device)
            if rep:
                for k, v in got.items():
                    times[k].append(v)
    finally:
        linker.close()
        del linker, pool, host, dev
        release_device_memory(device)
    times["offload_timeline"] = timelines
    times["restore_split"] = restore_splits
    return times


def copy_timeline(jobs: Any, started: float, ended: float) -> dict[str, Any]:
    """Where one offload's time went, from its copy jobs' own timestamps (ms):
    ``reserve`` from ``offload`` (or the previous job) to each job's queuing (the
    owner thread reserving that chunk's slots), ``wait`` queued to taken by the
    copier, ``issue`` taken to its copies queued (this thread's launches; on CPU
    the copy itself), ``copy`` queued to reported (the device copy and its
    settling), and ``result`` the last report to the offload's result."""
    mine = [j for j in jobs if started <= j.created <= ended]
    prev = started
    out: dict[str, Any] = {
        "jobs": len(mine),
        "pages": [],
        "reserve": [],
        "wait": [],
        "issue": [],
        "copy": [],
    }
    for job in mine:
        out["pages"].append(len(job.pairs))
        out["reserve"].append(span_ms(prev, job.created))
        out["wait"].append(span_ms(job.created, job.claimed))
        out["issue"].append(span_ms(job.claimed, job.issued))
        out["copy"].append(span_ms(job.issued, job.ended))
        prev = job.created
    out["result"] = span_ms(mine[-1].ended, ended) if mine else None
    return out


def bench_transfer(
    args: argparse.Namespace, out: dict[str, Any], metrics: list[dict[str, Any]]
) -> None:
    """Restore and offload GB/s against plain copies, per request size."""
    geo = Geometry(args.layers, args.heads, args.head_dim, args.page_size)
    rng = random.Random(args.seed + 5)
    on_cuda = args.device == "cuda"
    details: dict[str, Any] = {
        "device": args.device,
        "geometry": vars(geo),
        "method": "restore: load -> finish_layer_wise_loading (+ device sync) into "
        "scattered pool pages, vs host->device copy_ of the same bytes; offload: "
        "one copy into KVCR DRAM (default offload_path), offload() -> its FIFO "
        "result, vs device->host copy_ (and, informational, that copy on a side "
        "thread whose end the main thread polls every 0.5 ms as it polls the "
        "offload's: offload_vs_polled_d2h); "
        + (
            "host tensors pinned, copies non_blocking, torch.cuda.synchronize()"
            if on_cuda
            else "cpu: host-to-host copies (the CPU targets: offload >= 0.8, "
            "restore >= 0.9)"
        ),
    }
    out["transfer"] = details
    for n in args.transfer_pages:
        details[f"{n}p"], med, samples = _run_case(args, geo, n, rng, "")
        for name, value, base in (
            (f"restore_vs_pinned_h2d_{n}p", med["restore"], med["h2d"]),
            (f"offload_vs_pinned_d2h_{n}p", med["offload"], med["d2h"]),
            (f"offload_vs_polled_d2h_{n}p", med["offload"], med["d2h_polled"]),
        ):
            target = target_of(name, args.device)
            metrics.append(
                _ratio(name, value, base, args.device, samples, target=target)
            )
        if on_cuda and getattr(args, "previous_path_too", False):
            _previous_path_case(args, geo, n, rng, details, metrics)


def _run_case(
    args: argparse.Namespace, geo: Geometry, n: int, rng: random.Random, label: str
) -> tuple[dict[str, Any], dict[str, float], int]:
    """One ``transfer_case``: its report entry, the median GB/s per kind and the
    samples; prints the last rep's timelines (``label`` names the path)."""
    t0 = time.monotonic()
    times = transfer_case(args, geo, n, rng)
    timelines = times.pop("offload_timeline")
    splits = times.pop("restore_split")
    nbytes = n * geo.page_bytes
    rates = {k: [round(gbps(nbytes, x), 3) for x in v] for k, v in times.items()}
    entry = {
        "request_bytes": nbytes,
        "gbps": rates,
        "seconds": round(time.monotonic() - t0, 1),
        "offload_timeline": timelines,
        "restore_split": splits,
    }
    if timelines:
        print(
            f"[bench] {label}offload {n}p, last rep's copy jobs (ms): {timelines[-1]}"
        )
    if splits:
        print(f"[bench] {label}restore {n}p, last rep's split (ms): {splits[-1]}")
    med = {k: statistics.median(v) for k, v in rates.items()}
    return entry, med, len(rates["restore"])


def _ratio(
    name: str, value: float, base: float, device: str, samples: int, **kw: Any
) -> dict[str, Any]:
    return metric(name, value, "GB/s", base, samples=samples, device=device, **kw)


def _previous_path_case(
    args: argparse.Namespace,
    geo: Geometry,
    n: int,
    rng: random.Random,
    details: dict[str, Any],
    metrics: list[dict[str, Any]],
) -> None:
    """The same case on the previous device path (one stream, one torch call per
    part: the relay and the page-row kernel off), informational: what they buy,
    side by side in one run."""
    from sglang.srt.mem_cache.storage.kvcr.datapath import page_rows_kernel
    from sglang.srt.mem_cache.storage.kvcr.datapath.device_gather import (
        DeviceGather,
    )
    from sglang.srt.mem_cache.storage.kvcr.datapath.span_restore import SpanRestore

    saved = SpanRestore.TWO_STREAMS, DeviceGather.TWO_STREAMS
    kernel_off = page_rows_kernel._state["off"]
    SpanRestore.TWO_STREAMS = DeviceGather.TWO_STREAMS = False
    page_rows_kernel._state["off"] = True
    try:
        entry, med, samples = _run_case(args, geo, n, rng, "previous path: ")
    finally:
        SpanRestore.TWO_STREAMS, DeviceGather.TWO_STREAMS = saved
        page_rows_kernel._state["off"] = kernel_off
    details[f"{n}p_previous_path"] = entry
    for name, value, base in (
        (f"previous_path_restore_vs_pinned_h2d_{n}p", med["restore"], med["h2d"]),
        (f"previous_path_offload_vs_pinned_d2h_{n}p", med["offload"], med["d2h"]),
    ):
        metrics.append(
            _ratio(name, value, base, args.device, samples, informational=True)
        )
