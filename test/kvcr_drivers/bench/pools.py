"""A pool of a given geometry and the linker over it, as the microbench drives them.

Realistic geometries (Qwen3-0.6B-like: 28 layers, 8 KV heads, dim 128, bf16, page
64) on ``cpu`` or ``cuda``; the page-level steps (offload until its FIFO result,
prepare + lookup, restore) timed the way the sections report them.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any

from cpu_harness import kvcr_pages, kvcr_stack
from cpu_harness.kvcr_pages import wait_until

MIB = 1 << 20
GIB = 1 << 30
WAIT_S = 30.0
# Readiness polls (latency samples wait on them) sleep this long between checks:
# the sleeps release the GIL.
READY_POLL_S = 50e-6
# How often offload_once asks for the result: about a scheduler step's pace.
# SGLang asks once per step; a 50 us busy poll would take one of this machine's
# two cores from the copy it is timing.
OFFLOAD_POLL_S = 0.5e-3
BENCH_MODEL = "bench-geometry"


@dataclass
class Geometry:
    layers: int
    heads: int
    head_dim: int
    page: int

    @property
    def part_bytes(self) -> int:  # one page of one K or V layer buffer, bf16
        return self.page * self.heads * self.head_dim * 2

    @property
    def page_bytes(self) -> int:  # every K and V part of one page
        return 2 * self.layers * self.part_bytes


def make_pool(geo: Geometry, pages: int, device: str = "cpu") -> Any:
    return kvcr_stack.mha_pool(
        pages * geo.page, geo.page, geo.heads, geo.head_dim, geo.layers, device
    )


def sync(device: str) -> None:
    """Wait for the device's queued work; CPU copies are synchronous (no-op)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def host_bytes(nbytes: int, device: str) -> Any:
    """Host memory a device copies from or into: pinned when the device is CUDA."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")


def release_device_memory(device: str) -> None:
    """Free what the last case left (settle() froze it out of the collector)."""
    gc.unfreeze()
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def linker_args(geo: Geometry, dram_pages: int, **overrides: Any) -> dict[str, Any]:
    """``kvcr_pages.make_linker`` keyword arguments of a bench linker over a
    ``geo`` pool: ``dram_pages`` pages of KVCR DRAM, long timeouts, budgets no case
    reaches; ``overrides`` are linker config fields."""
    return {
        "page": geo.page,
        "model": BENCH_MODEL,
        "local_dram_bytes_per_worker": dram_pages * geo.page_bytes,
        "operation_timeout_ms": 10000,
        "abandon_timeout_ms": 20000,
        "preparation_timeout_ms": 10000,
        "max_inflight_offload_bytes": 4 * GIB,
        "max_inflight_prepare_bytes": 4 * GIB,
        "max_abandoned_bytes": 4 * GIB,
        **overrides,
    }


def kv_transfer(
    geo: Geometry,
    hashes: list[str],
    pages: list[int] | None = None,
    device: str = "cpu",
):
    """The KV ``PoolTransfer``; its device indices on ``device``, as SGLang passes
    them (CUDA tensors on a GPU pool)."""
    return kvcr_pages.kv_transfer(hashes, pages, device, page=geo.page)


def page_rows(pool: Any, geo: Geometry) -> list[Any]:
    """Each K/V layer buffer as one uint8 row per page."""
    import torch

    out = []
    for buf in kvcr_pages.buffers(pool):
        pages = buf.shape[0] // geo.page
        flat = buf[: pages * geo.page].reshape(-1).view(torch.uint8)
        out.append(flat.view(pages, geo.part_bytes))
    return out


def pages_equal(pool: Any, geo: Geometry, a: list[int], b: list[int]) -> bool:
    import torch

    return all(
        torch.equal(
            rows.index_select(0, torch.tensor(a, device=rows.device)),
            rows.index_select(0, torch.tensor(b, device=rows.device)),
        )
        for rows in page_rows(pool, geo)
    )


def offload_once(
    linker: Any, geo: Geometry, hashes: list[str], pages: list[int], device: str = "cpu"
):
    """Seconds from ``offload`` to its completed FIFO result (must succeed)."""
    transfers = kv_transfer(geo, hashes, pages, device)
    sync(device)
    t0 = time.perf_counter()
    linker.offload(transfers)
    wait_until(
        lambda: linker.num_completed_offloads() >= 1,
        WAIT_S,
        "offload completion",
        poll_s=OFFLOAD_POLL_S,
    )
    elapsed = time.perf_counter() - t0
    if not linker.pop_completed_offload():
        raise RuntimeError(f"offload failed: {linker.stats_line()}")
    return elapsed


def prepare_and_lookup(linker: Any, rid: str, transfers: Any, hint: Any = None):
    """(total s, scheduler-call s, hit pages) of prepare -> ready -> lookup."""
    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
        LinkerRequestContext,
    )

    ctx = LinkerRequestContext(rid, 0, hint)
    linker.num_completed_offloads()  # a scheduler step starts (once per step)
    t0 = time.perf_counter()
    handle = linker.prepare_request(ctx, transfers)
    t1 = time.perf_counter()
    waited = 0.0
    if not linker.preparation_ready(handle):
        w0 = time.perf_counter()
        wait_until(
            lambda: linker.preparation_ready(handle),
            WAIT_S,
            f"{rid} prepared",
            poll_s=READY_POLL_S,
        )
        waited = time.perf_counter() - w0
    t2 = time.perf_counter()
    hit = linker.lookup(rid, transfers)
    t3 = time.perf_counter()
    return t3 - t0, (t1 - t0) + (t3 - t2), len(hit), waited


def copy_once(dst: Any, src: Any, device: str) -> float:
    """Seconds of one ``copy_`` (non-blocking on CUDA, waited for)."""
    sync(device)
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    sync(device)
    return time.perf_counter() - t0


def polled_copy_once(dst: Any, src: Any, device: str, poll_s: float) -> float:
    """Seconds from starting ``copy_once`` on a side thread until this thread,
    checking every ``poll_s``, sees it done: the shape of ``offload_once`` (the
    copy on another thread, its end seen by a poll), so the plain copy pays the
    same wake-ups (on a small host each one preempts a copying core) and the
    same detection delay."""
    import threading

    done = threading.Event()
    failed: list[BaseException] = []
    on_device = [t.device.index for t in (dst, src) if t.device.type == "cuda"]
    index = on_device[0] if on_device else None  # the side thread binds to it

    def run() -> None:
        try:
            if index is not None:
                import torch

                torch.cuda.set_device(index)
            copy_once(dst, src, device)
        except BaseException as exc:
            failed.append(exc)
        finally:
            done.set()

    t0 = time.perf_counter()
    copier = threading.Thread(target=run, name="bench-polled-copy", daemon=True)
    copier.start()
    wait_until(done.is_set, WAIT_S, "plain copy", poll_s=poll_s)
    elapsed = time.perf_counter() - t0
    copier.join(WAIT_S)
    if failed:
        raise RuntimeError("the polled plain copy failed") from failed[0]
    return elapsed


def restore_once(
    linker: Any,
    geo: Geometry,
    rid: str,
    hashes: list[str],
    dest: list[int],
    device: str,
    split: list[dict[str, float | None]] | None = None,
) -> float:
    """Seconds from ``load`` until the restore finished and the device is idle
    (prepare and lookup run first, untimed: they happen at enqueue); with
    ``split``, where that time went is appended to it (``restore_split``)."""
    _, _, hit, _ = prepare_and_lookup(linker, rid, kv_transfer(geo, hashes))
    if hit != len(hashes):
        raise RuntimeError(f"restore lookup hit {hit} of {len(hashes)} pages")
    transfers = kv_transfer(geo, hashes, dest, device)
    sync(device)
    t0 = time.perf_counter()
    m0 = time.monotonic()
    linker.load(rid, transfers)
    index = linker.start_layer_wise_loading()
    ok = linker.finish_layer_wise_loading(index)
    sync(device)
    elapsed = time.perf_counter() - t0
    if split is not None:
        split.append(restore_split(linker.restorer.last_times, m0, time.monotonic()))
    linker.finish_request(rid)
    if not ok:
        raise RuntimeError(f"restore failed: {linker.stats_line()}")
    return elapsed


def span_ms(a: float, b: float) -> float | None:
    """Milliseconds from ``a`` to ``b`` (monotonic), None when either step was
    not reached (a timeline's 0.0)."""
    return round((b - a) * 1e3, 3) if a and b else None


def restore_split(times: Any, began: float, ended: float) -> dict[str, float | None]:
    """Where one restore's time went (ms), from the batch's own timeline:
    ``start`` load to the batch started, ``wake`` to the copying thread taking
    it, ``issue`` to its copies queued (this thread's launches; on CPU the copy
    itself), ``copy`` to the stream drained (GPU only), ``finish`` to the end."""
    last = times.drained or times.issued or times.taken
    return {
        "start": span_ms(began, times.started),
        "wake": span_ms(times.started, times.taken),
        "issue": span_ms(times.taken, times.issued),
        "copy": span_ms(times.issued, times.drained),
        "finish": span_ms(last, ended),
    }


def zero_pages(pool: Any, geo: Geometry, pages: list[int]) -> None:
    import torch

    for rows in page_rows(pool, geo):
        rows.index_fill_(0, torch.tensor(pages, device=rows.device), 0)
