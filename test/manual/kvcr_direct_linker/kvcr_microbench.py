"""CPU benchmark of the KVCR direct linker against plain baselines (``make bench``).

Measures, in one run and side by side:

(e) ``zero_hit_ttft_ratio``: median streaming TTFT of unique prompts on the CPU
    SGLang server with the KVCR linker over the same prompts without it. Runs
    first, before any KVCR lives in this process. The servers are up together
    and run one at a time (the others SIGSTOPped), in rotating order, so load
    from elsewhere hits every variant alike; a third server with SGLang's Python
    radix tree core (which the plugin selects) splits that cost from the linker's.
(a) ``restore_copy_vs_torch_copy``: the linker's real restore path (prepare,
    lookup, load, start/finish_layer_wise_loading) from claimed KVCR DRAM into a
    real CPU ``MHATokenToKVPool`` of Qwen3-0.6B-like geometry (28 layers, 8 KV
    heads, dim 128, bf16, page 64), timed from ``load`` to ``finish``, against a
    plain torch ``copy_`` of the same bytes. The worse of a contiguous and a
    scattered destination is the headline.
(b) ``offload_vs_nixl_loopback``: ``linker.offload`` until its result is
    complete, against a raw NIXL DRAM loopback WRITE of the same bytes with the
    same descriptor shape (one agent, progress thread off as in the linker).
(c) ``zero_hit_prepare_us_p50`` / ``hit_prepare_us_p50`` / ``hint_prepare_us_p50``:
    prepare_request + preparation_ready (waited for) + lookup of one request's
    47 pages with nothing resident, everything resident, and everything named by a
    hint to a second linker instance. ``zero_hit_owner_commands`` counts what the
    zero-hit path sends the KVCR owner thread (must be nothing) plus requests that
    were not ready at once.
(d) ``hook_overhead_us_p50``: integration._after_add_request_to_queue plus one
    _around_get_new_batch_prefill pass per request over a real UnifiedRadixCache,
    with an idle KVCR linker, against the same calls with no linker;
    ``linker_idle_cpu_pct`` is what the idle linker's threads use meanwhile.

(e') ``decode_itl_p50_ratio`` / ``decode_itl_p99_ratio`` (serving section, before
    the TTFT rounds): per-token inter-token latency of one streaming request that
    decodes ``--itl-output-len`` tokens while unique prompts arrive (one per
    ``--itl-every-tokens`` of its output) and make the kvcr server write pages
    through, over the same load on the
    ``none`` server (``decode_itl.py`` says what a sample is). The KVCR_STATS
    delta over the rounds proves the write-through happened; a phase that offloaded
    nothing is an error, not a number.
(f) ``restore_vs_pinned_h2d_<n>p`` / ``offload_vs_pinned_d2h_<n>p`` (transfer
    section) at ``--transfer-pages`` (47 and 256 on cuda, 47 on cpu): a pool of
    that geometry on ``--device``; the restore into scattered pool pages against
    a host-to-device ``copy_`` of the same bytes from a pinned tensor, and the
    staged offload
    (``offload_path: staged``, until its FIFO result) against a device-to-host
    ``copy_`` into pinned memory; device index tensors on the device, as SGLang
    passes them. The same code runs on cpu (host-to-host copies, no pinning,
    informational) and on cuda (targets 0.8 and 0.7; every CUDA call is behind
    ``--device cuda``). On cuda only this section runs unless ``--skip`` says
    otherwise.

``--quick`` is a dry run (fewest reps and samples, short prompts, 47 pages only).

Before each section it waits (bounded) for the machine to be mostly idle and
records what it saw. Prints a summary table; the last line is ``REPORT <path>``
(JSON with a top-level ``metrics`` list of name/value/unit/baseline/ratio/target/
passed). Exits non-zero when any metric misses its target; informational metrics
have no target.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import os
import random
import statistics
import sys
import time
import traceback
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(HERE))

import decode_itl  # noqa: E402
import kvcr_bench  # noqa: E402

from cpu_harness import server as harness  # noqa: E402
from cpu_harness.tiny_model import ensure_tiny_model  # noqa: E402

_MIB = 1 << 20
_GIB = 1 << 30
_WAIT_S = 30.0
_READY_POLL_S = 50e-6  # sleeps between readiness checks release the GIL


@dataclass(frozen=True)
class Target:
    field: str  # "value" or "ratio"
    op: str
    bound: float

    def text(self) -> str:
        return f"{self.field} {self.op} {self.bound:g}"

    def check(self, metric: dict[str, Any]) -> bool:
        got = metric.get(self.field)
        if got is None or (isinstance(got, float) and math.isnan(got)):
            return False
        return {
            "<=": got <= self.bound,
            ">=": got >= self.bound,
            "==": got == self.bound,
        }[self.op]


TRANSFER_PAGES = (47, 256)  # a 3000-token prompt at page 64, and a long context
SECTION_NAMES = ("serving", "copy", "prepare", "hint", "hooks", "transfer")
# Skipped unless --skip says otherwise: on cuda every section but transfer (the
# others measure CPU pools, CPU-side calls or the tiny CPU model, the same on any
# host; kvcr_bench.py is the GPU serving bench).
DEFAULT_TRANSFER = {"cpu": "47", "cuda": "47,256"}
DEFAULT_SKIP = {"cpu": "", "cuda": "serving,copy,prepare,hint,hooks"}

# The CPU targets (ratios measured side by side in this run).
TARGETS: dict[str, Target | None] = {
    "zero_hit_ttft_ratio": Target("ratio", "<=", 1.05),
    "restore_copy_vs_torch_copy": Target("ratio", ">=", 0.8),
    "offload_vs_nixl_loopback": Target("ratio", ">=", 0.7),
    "zero_hit_prepare_us_p50": Target("value", "<=", 100.0),
    "zero_hit_owner_commands": Target("value", "==", 0),
    # Off the critical path (prepared at enqueue) and replacing a whole prefill;
    # dominated by KVCR's own fetch of 47 blocks of 56 parts (~3 ms of Python).
    "hit_prepare_us_p50": Target("value", "<=", 10000.0),
    "hint_prepare_us_p50": None,  # informational: bound by the peer transfer
    "hook_overhead_us_p50": Target("value", "<=", 150.0),
    "linker_idle_cpu_pct": None,  # informational: background cost of an idle linker
    # Foreground decode ITL under write-through load, kvcr over none (serving).
    "decode_itl_p50_ratio": None,
    "decode_itl_p99_ratio": Target("ratio", "<=", 1.1),
    # The CUDA targets (issue 11); on cpu the same figures are informational.
    **{
        f"restore_vs_pinned_h2d_{n}p": Target("ratio", ">=", 0.8)
        for n in TRANSFER_PAGES
    },
    **{
        f"offload_vs_pinned_d2h_{n}p": Target("ratio", ">=", 0.7)
        for n in TRANSFER_PAGES
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the transfer section's pool lives (cuda: every other use of "
        "CUDA is behind this flag)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="dry run: fewest reps and samples, short prompts (minutes on 2 cores)",
    )
    p.add_argument(
        "--transfer-pages",
        default="",
        help="request sizes in pages for the transfer section (default: 47,256 on "
        "cuda; 47 on cpu, where 256 pages cost minutes and ~12 GB of memory)",
    )
    p.add_argument("--itl-rounds", type=int, default=8, help="decode_itl rounds")
    p.add_argument("--itl-output-len", type=int, default=96)
    p.add_argument("--itl-concurrency", type=int, default=2)
    p.add_argument(
        "--itl-every-tokens",
        type=int,
        default=16,
        help="decode_itl: one background prompt per this many decoded tokens",
    )
    p.add_argument(
        "--itl-stats-wait-s",
        type=float,
        default=40.0,
        help="after the decode_itl rounds, wait up to this long for a KVCR_STATS "
        "line (logged every 30 s) to count what was offloaded",
    )
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument(
        "--request-pages",
        type=int,
        default=47,
        help="pages per request (a 3000-token prompt at page 64 spans 47)",
    )
    p.add_argument(
        "--hint-layers",
        type=int,
        default=2,
        help="layers of the peer pair in the hint case (bytes per sample shrink; "
        "the per-page key count, which the call path depends on, does not)",
    )
    p.add_argument("--samples", type=int, default=300, help="latency samples")
    p.add_argument("--copy-reps", type=int, default=9, help="bandwidth repetitions")
    p.add_argument("--ttft-prompts", type=int, default=40)
    p.add_argument("--ttft-prompt-len", type=int, default=1024)
    p.add_argument("--ttft-page-size", type=int, default=16)
    p.add_argument("--ttft-warmup", type=int, default=5)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument(
        "--quiet-busy",
        type=float,
        default=0.25,
        help="before each section, wait until at most this share of the CPUs is "
        "busy (other work on a shared machine skews every number)",
    )
    p.add_argument("--quiet-wait-s", type=float, default=60.0)
    p.add_argument(
        "--quiet-round-busy",
        type=float,
        default=0.10,
        help="serving rounds during which other processes used more than this "
        "share of the CPUs are replaced (kept in the report, not in the medians)",
    )
    p.add_argument(
        "--skip",
        default=None,
        help="comma-separated sections to skip: "
        + ",".join(SECTION_NAMES)
        + f" (default: {DEFAULT_SKIP['cuda']!r} on cuda, none on cpu)",
    )
    p.add_argument("--report", default="", help="report path (default under .cache)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        apply_quick(args, p)
    sections = set(SECTION_NAMES)
    if args.skip is None:
        args.skip = DEFAULT_SKIP[args.device]
    args.skip = {s for s in args.skip.split(",") if s}
    try:
        args.transfer_pages = [
            int(x)
            for x in (args.transfer_pages or DEFAULT_TRANSFER[args.device]).split(",")
            if x
        ]
    except ValueError:
        p.error("--transfer-pages: comma-separated page counts")
    if not args.transfer_pages or min(args.transfer_pages) < 1:
        p.error("--transfer-pages: page counts must be >= 1")
    if args.device == "cuda" and not cuda_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    if args.itl_rounds < 1 or args.itl_output_len < 8 or args.itl_concurrency < 1:
        p.error("--itl-rounds >= 1, --itl-output-len >= 8, --itl-concurrency >= 1")
    if args.itl_every_tokens < 1:
        p.error("--itl-every-tokens must be >= 1")
    if args.skip - sections:
        p.error(
            f"--skip: unknown {sorted(args.skip - sections)}; of {sorted(sections)}"
        )
    for name in ("layers", "heads", "head_dim", "page_size", "request_pages"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.hint_layers < 1 or args.hint_layers > args.layers:
        p.error("--hint-layers must be in [1, --layers]")
    if args.samples < 200:
        p.error("--samples must be >= 200 (p50 over at least 200 samples)")
    if args.copy_reps < 3:
        p.error("--copy-reps must be >= 3")
    if not 0 < args.quiet_busy <= 1 or args.quiet_wait_s < 0:
        p.error("--quiet-busy must be in (0, 1] and --quiet-wait-s >= 0")
    if not 0 < args.quiet_round_busy <= 1:
        p.error("--quiet-round-busy must be in (0, 1]")
    if args.ttft_prompts < 5 or args.ttft_warmup < 0:
        p.error("--ttft-prompts must be >= 5 and --ttft-warmup >= 0")
    if args.ttft_prompt_len < 2 * args.ttft_page_size:
        p.error("--ttft-prompt-len must cover two pages of --ttft-page-size")
    return args


# Values --quick uses unless the option was given explicitly.
QUICK = {
    "samples": 200,
    "copy_reps": 3,
    "ttft_prompts": 5,
    "ttft_prompt_len": 256,
    "ttft_warmup": 1,
    "quiet_wait_s": 3.0,
    "itl_rounds": 2,
    "itl_output_len": 64,
    "transfer_pages": "47",
}


def apply_quick(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    for name, value in QUICK.items():
        if getattr(args, name) == p.get_default(name):
            setattr(args, name, value)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# ---- small helpers ---------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def dist(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50": round(statistics.median(values), 3),
        "p90": round(pct(values, 0.9), 3),
        "p99": round(pct(values, 0.99), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = _WAIT_S):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not reached within {timeout} s")
        time.sleep(_READY_POLL_S)


def busy_fraction(interval_s: float = 1.0) -> float:
    """Share of all CPUs' time not idle over ``interval_s`` (from /proc/stat)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    total0, idle0 = sample()
    time.sleep(interval_s)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_for_quiet(limit: float, timeout_s: float) -> dict[str, Any]:
    """Wait (bounded) until the machine is mostly idle; say what was seen."""
    deadline = time.monotonic() + timeout_s
    seen = busy_fraction()
    waited = 0.0
    while seen > limit and time.monotonic() < deadline:
        waited += 1.0
        seen = busy_fraction()
    return {"busy": round(seen, 3), "quiet": seen <= limit, "waited_s": waited}


def thread_cpu_pct(seconds: float) -> dict[str, float]:
    """CPU each thread of this process used over ``seconds``, in % of one core."""
    import threading

    def ticks() -> dict[int, int]:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            out[int(tid)] = int(fields[11]) + int(fields[12])
        return out

    hz = os.sysconf("SC_CLK_TCK")
    before = ticks()
    time.sleep(seconds)
    after = ticks()
    names = {t.native_id: t.name for t in threading.enumerate()}
    used: dict[str, float] = {}
    for tid, n in after.items():
        name = names.get(tid, "native")
        pct_core = 100.0 * (n - before.get(tid, n)) / hz / seconds
        used[name] = round(used.get(name, 0.0) + pct_core, 1)
    return {k: v for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v}


def settle() -> None:
    """Collect, then freeze survivors so GC pauses stay out of the samples."""
    gc.collect()
    gc.freeze()


def random_hashes(rng: random.Random, n: int) -> list[str]:
    return [f"{rng.getrandbits(256):064x}" for _ in range(n)]


def metric(
    name: str,
    value: float | None,
    unit: str,
    baseline: float | None = None,
    *,
    ratio: float | None = None,
    error: str | None = None,
    informational: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    if ratio is None and value is not None and baseline:
        ratio = value / baseline
    target = None if informational else TARGETS.get(name)
    m: dict[str, Any] = {
        "name": name,
        "value": None if value is None else round(value, 4),
        "unit": unit,
        "baseline": None if baseline is None else round(baseline, 4),
        "ratio": None if ratio is None else round(ratio, 4),
        "target": None if target is None else target.text(),
    }
    m["passed"] = None if target is None else (error is None and target.check(m))
    if error:
        m["error"] = error
    m.update(extra)
    return m


# ---- linker over a real CPU pool -----------------------------------------------


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
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        pages * geo.page,
        geo.page,
        torch.bfloat16,
        geo.heads,
        geo.head_dim,
        geo.layers,
        device=device,
        enable_memory_saver=False,
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


def make_linker(pool: Any, geo: Geometry, kvcr_pages: int, **overrides: Any) -> Any:
    from cpu_harness import kvcr_stack

    config = {
        "local_dram_bytes_per_worker": kvcr_pages * geo.page_bytes,
        "operation_timeout_ms": 10000,
        "abandon_timeout_ms": 20000,
        "preparation_timeout_ms": 10000,
        "max_inflight_offload_bytes": 4 * _GIB,
        "max_inflight_prepare_bytes": 4 * _GIB,
        "max_abandoned_bytes": 4 * _GIB,
        **overrides,
    }
    return kvcr_stack.bare_linker(pool, geo.page, config, model="bench-geometry")


def kv_transfer(
    geo: Geometry,
    hashes: list[str],
    pages: list[int] | None = None,
    device: str = "cpu",
):
    """The KV ``PoolTransfer``; its device indices on ``device``, as SGLang passes
    them (CUDA tensors on a GPU pool)."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import (
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )

    indices = None
    if pages is not None:
        tokens = torch.arange(geo.page, dtype=torch.int64)
        indices = torch.cat([p * geo.page + tokens for p in pages]).to(device)
    return [
        PoolTransfer(
            name=PoolName.KV,
            keys=list(hashes),
            device_indices=indices,
            hit_policy=PoolHitPolicy.ALL_PAGES,
        )
    ]


def pool_parts(pool: Any) -> list[Any]:
    return [b for pair in zip(pool.k_buffer, pool.v_buffer, strict=True) for b in pair]


def page_rows(pool: Any, geo: Geometry) -> list[Any]:
    """Each K/V layer buffer as one uint8 row per page."""
    import torch

    out = []
    for buf in pool_parts(pool):
        pages = buf.shape[0] // geo.page
        flat = buf[: pages * geo.page].reshape(-1).view(torch.uint8)
        out.append(flat.view(pages, geo.part_bytes))
    return out


def fill_random(pool: Any, geo: Geometry, pages: list[int], seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    for rows in page_rows(pool, geo):
        index = torch.tensor(pages, dtype=torch.long, device=rows.device)
        data = torch.randint(
            0, 256, (len(pages), geo.part_bytes), dtype=torch.uint8, generator=gen
        )
        rows.index_copy_(0, index, data.to(rows.device))


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
    wait_until(lambda: linker.num_completed_offloads() >= 1, "offload completion")
    elapsed = time.perf_counter() - t0
    if not linker.pop_completed_offload():
        raise RuntimeError(f"offload failed: {linker.stats_line()}")
    return elapsed


def prepare_and_lookup(linker: Any, rid: str, transfers: Any, hint: Any = None):
    """(total s, scheduler-call s, hit pages) of prepare -> ready -> lookup."""
    from sglang.srt.mem_cache.storage.kvcr.linker_hooks import LinkerRequestContext

    ctx = LinkerRequestContext(rid, 0, hint)
    t0 = time.perf_counter()
    handle = linker.prepare_request(ctx, transfers)
    t1 = time.perf_counter()
    waited = 0.0
    if not linker.preparation_ready(handle):
        w0 = time.perf_counter()
        wait_until(lambda: linker.preparation_ready(handle), f"{rid} prepared")
        waited = time.perf_counter() - w0
    t2 = time.perf_counter()
    hit = linker.lookup(rid, transfers)
    t3 = time.perf_counter()
    return t3 - t0, (t1 - t0) + (t3 - t2), len(hit), waited


# ---- (a)(b)(c): bandwidth and preparation on realistic geometry ------------------


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
        deadline = time.monotonic() + _WAIT_S
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
    fill_random(pool, geo, src_pages, seed=1)
    linker = make_linker(pool, geo, kvcr_pages=2 * n)
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


# ---- (f) restore / offload against plain host<->device copies (cpu or cuda) -----


def copy_once(dst: Any, src: Any, device: str) -> float:
    """Seconds of one ``copy_`` (non-blocking on CUDA, waited for)."""
    sync(device)
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    sync(device)
    return time.perf_counter() - t0


def restore_once(
    linker: Any,
    geo: Geometry,
    rid: str,
    hashes: list[str],
    dest: list[int],
    device: str,
) -> float:
    """Seconds from ``load`` until the restore finished and the device is idle
    (prepare and lookup run first, untimed: they happen at enqueue)."""
    _, _, hit, _ = prepare_and_lookup(linker, rid, kv_transfer(geo, hashes))
    if hit != len(hashes):
        raise RuntimeError(f"restore lookup hit {hit} of {len(hashes)} pages")
    transfers = kv_transfer(geo, hashes, dest, device)
    sync(device)
    t0 = time.perf_counter()
    linker.load(rid, transfers)
    index = linker.start_layer_wise_loading()
    ok = linker.finish_layer_wise_loading(index)
    sync(device)
    elapsed = time.perf_counter() - t0
    linker.finish_request(rid)
    if not ok:
        raise RuntimeError(f"restore failed: {linker.stats_line()}")
    return elapsed


def zero_pages(pool: Any, geo: Geometry, pages: list[int]) -> None:
    import torch

    for rows in page_rows(pool, geo):
        rows.index_fill_(0, torch.tensor(pages, device=rows.device), 0)


def transfer_case(
    args: argparse.Namespace, geo: Geometry, n: int, rng: random.Random
) -> dict[str, list[float]]:
    """Seconds per rep of: the staged offload of ``n`` scattered pool pages until
    its FIFO result; a device-to-host copy of the same bytes into (pinned) host
    memory; the restore of those pages from claimed KVCR DRAM into ``n`` other
    scattered pool pages; a host-to-device copy from a (pinned) host tensor.
    Interleaved rep by rep; rep 0 warms up and checks the restore byte for byte."""
    import torch

    device = args.device
    nbytes = n * geo.page_bytes
    order = rng.sample(range(1, 1 + 2 * n), 2 * n)
    src_pages, dst_pages = order[:n], order[n:]
    pool = make_pool(geo, 1 + 2 * n, device)
    fill_random(pool, geo, src_pages, seed=7)
    linker = make_linker(
        pool,
        geo,
        kvcr_pages=n + max(8, n // 4),
        offload_path="staged",
        max_inflight_offload_bytes=nbytes + geo.page_bytes,
    )
    host = host_bytes(nbytes, device)
    host.random_(0, 256)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times: dict[str, list[float]] = {"offload": [], "d2h": [], "restore": [], "h2d": []}
    try:
        settle()
        for rep in range(args.copy_reps + 1):
            hashes = random_hashes(rng, n)
            got = {"offload": offload_once(linker, geo, hashes, src_pages, device)}
            got["d2h"] = copy_once(host, dev, device)
            if rep == 0:
                zero_pages(pool, geo, dst_pages)
            got["restore"] = restore_once(
                linker, geo, f"t{n}-{rep}", hashes, dst_pages, device
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
    return times


def bench_transfer(
    args: argparse.Namespace, out: dict[str, Any], metrics: list[dict[str, Any]]
) -> None:
    """Restore and staged offload GB/s against plain copies, per request size."""
    geo = Geometry(args.layers, args.heads, args.head_dim, args.page_size)
    rng = random.Random(args.seed + 5)
    on_cuda = args.device == "cuda"
    details: dict[str, Any] = {
        "device": args.device,
        "geometry": vars(geo),
        "method": "restore: load -> finish_layer_wise_loading (+ device sync) into "
        "scattered pool pages, vs host->device copy_ of the same bytes; offload: "
        "offload_path staged, offload() -> its FIFO result, vs device->host copy_; "
        + (
            "host tensors pinned, copies non_blocking, torch.cuda.synchronize()"
            if on_cuda
            else "cpu: host-to-host copies, informational (targets apply on cuda)"
        ),
    }
    out["transfer"] = details
    for n in args.transfer_pages:
        t0 = time.monotonic()
        times = transfer_case(args, geo, n, rng)
        nbytes = n * geo.page_bytes
        rates = {k: [round(gbps(nbytes, x), 3) for x in v] for k, v in times.items()}
        details[f"{n}p"] = {
            "request_bytes": nbytes,
            "gbps": rates,
            "seconds": round(time.monotonic() - t0, 1),
        }
        med = {k: statistics.median(v) for k, v in rates.items()}
        for name, value, base in (
            (f"restore_vs_pinned_h2d_{n}p", med["restore"], med["h2d"]),
            (f"offload_vs_pinned_d2h_{n}p", med["offload"], med["d2h"]),
        ):
            metrics.append(
                metric(
                    name,
                    value,
                    "GB/s",
                    base,
                    informational=not on_cuda,
                    samples=len(rates["restore"]),
                    device=args.device,
                )
            )


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
    hit_total, hit_calls, misses = [], [], 0
    settle()
    for i in range(args.samples + 20):
        total, calls, hit, _ = prepare_and_lookup(linker, f"h{i}", transfers)
        misses += hit != n
        linker.release_request(f"h{i}")
        if i >= 20:
            hit_total.append(total * 1e6)
            hit_calls.append(calls * 1e6)
    details["hit_us"] = dist(hit_total)
    details["hit_scheduler_call_us"] = dist(hit_calls)
    details["hit_short_lookups"] = misses
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


def bench_hint(
    args: argparse.Namespace, out: dict[str, Any], metrics: list[dict[str, Any]]
) -> None:
    """B prepares pages only A holds, told by a kv.fetch hint naming A."""
    from sglang.srt.mem_cache.storage.kvcr.router_hint import page_hash_to_u64

    rng = random.Random(args.seed + 1)
    geo = Geometry(args.hint_layers, args.heads, args.head_dim, args.page_size)
    n = args.request_pages
    pool_a, pool_b = make_pool(geo, 3 + 2 * n), make_pool(geo, 3 + n)
    a = make_linker(pool_a, geo, kvcr_pages=2 * n)
    # B holds exactly one request: alternating two prompts evicts the other, so
    # every sample's pages are remote.
    b = make_linker(pool_b, geo, kvcr_pages=n)
    try:
        prompts = []
        for j in range(2):
            pages = list(range(1 + j * n, 1 + (j + 1) * n))
            fill_random(pool_a, geo, pages, seed=10 + j)
            hashes = random_hashes(rng, n)
            offload_once(a, geo, hashes, pages)
            hint = {
                "protocol_version": "1.0",
                "message_id": f"bench-{j}",
                "actions": [
                    {
                        "action_id": "fetch-0",
                        "action_type": "kv.fetch",
                        "action_version": "1.0",
                        "payload": {
                            "source_control_endpoint": a.endpoint,
                            "block_hashes": [page_hash_to_u64(h) for h in hashes],
                        },
                    }
                ],
            }
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
                f"{n * geo.page_bytes / _MIB:.1f} MiB from the peer",
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

    from sglang.srt.mem_cache.storage.kvcr import integration

    load_plugins()
    page = args.page_size
    prompt_len = args.request_pages * page - page // 2  # e.g. 2976 at page 64
    pool_tokens = 4 * args.request_pages * page
    config = {
        "local_dram_bytes_per_worker": 64 * _MIB,
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


# Diagnostic server variants (name, extra flags, extra env) a caller may add.
EXTRA_SERVING_VARIANTS: list[tuple[str, list[str], dict[str, str] | None]] = []


# ---- (e) serving TTFT ----------------------------------------------------------------


class CpuMeter:
    """Splits machine CPU time into ours (this process and the server groups) and
    everyone else's, from /proc, so rounds disturbed by other work can be told."""

    def __init__(self, pgids: set[int]) -> None:
        self.pgids = pgids
        self.me = os.getpid()

    def _own(self) -> int:
        ticks = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(entry) == self.me or int(fields[2]) in self.pgids:
                ticks += int(fields[11]) + int(fields[12])
        return ticks

    def snapshot(self) -> tuple[int, int, int]:
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
        return sum(cpu), sum(cpu) - cpu[3] - cpu[4], self._own()

    @staticmethod
    def external(a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
        """Share of all CPUs used by processes not ours between two snapshots."""
        total = max(1, b[0] - a[0])
        return max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / total)


def _stamp(t: float) -> str:
    """``t`` as SGLang's log lines stamp it (local time, whole seconds)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def stats_after(
    server: harness.ServerHandle, since: float, timeout_s: float
) -> tuple[str, str] | None:
    """The first KVCR_STATS line stamped at or after ``since`` (logged every 30 s
    from the scheduler's pump; the server is kept stepping with requests shorter
    than a page, which offload nothing), or None at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        later = [
            x
            for x in decode_itl.stamped_stats(server.log_text())
            if x[0] >= _stamp(since)
        ]
        if later or time.monotonic() >= deadline:
            return later[0] if later else None
        server.generate(input_ids=[5, 6, 7], max_new_tokens=1, timeout=30.0)
        time.sleep(0.5)


def bench_decode_itl(
    args: argparse.Namespace,
    servers: dict[str, harness.ServerHandle],
    details: dict[str, Any],
    metrics: list[dict[str, Any]],
) -> None:
    """Foreground decode ITL of one streaming request while paced unique prompts
    make the kvcr server write pages through, kvcr against none, rounds in
    alternating order (one server running at a time)."""
    page = args.ttft_page_size
    vocab = 300
    fg = decode_itl.prompt_maker(args.seed + 40, 48, vocab)
    runs = {name: servers[name] for name in ("none", "kvcr")}
    itl: dict[str, Any] = {
        "method": decode_itl.__doc__,
        "background_prompt_len": args.ttft_prompt_len,
        "background_pages_per_prompt": kvcr_bench.page_aligned(
            args.ttft_prompt_len, page
        )
        // page,
        "every_tokens": args.itl_every_tokens,
        "output_len": args.itl_output_len,
        "concurrency": args.itl_concurrency,
    }
    details["decode_itl"] = itl
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    started = time.time()
    for i in range(1 + args.itl_rounds):  # round 0 warms both up
        ids = fg()
        order = list(runs) if i % 2 == 0 else list(runs)[::-1]
        for name in order:
            with kvcr_bench.running(runs[name]):
                r = decode_itl.itl_round(
                    runs[name].base_url,
                    ids,
                    decode_itl.prompt_maker(
                        args.seed + 100 + i, args.ttft_prompt_len, vocab
                    ),
                    concurrency=args.itl_concurrency,
                    every_tokens=args.itl_every_tokens,
                    output_len=args.itl_output_len if i else 8,
                    timeout=120.0,
                )
            if i:
                rounds[name].append(r)
    ended = time.time()
    with kvcr_bench.running(runs["kvcr"]):
        before = [
            x
            for x in decode_itl.stamped_stats(runs["kvcr"].log_text())
            if x[0] < _stamp(started)
        ]
        after = stats_after(runs["kvcr"], ended + 1.0, args.itl_stats_wait_s)
    offloaded = None
    if after is not None:
        first = kvcr_bench.parse_stats(before[-1][1]) if before else {}
        last = kvcr_bench.parse_stats(after[1])
        offloaded = {
            k: int(last.get(k, 0) - first.get(k, 0))
            for k in (
                "offloads",
                "offload_pages",
                "offloaded_bytes",
                "offload_failures",
            )
        }
    summary = {name: decode_itl.itl_summary(r) for name, r in rounds.items()}
    itl.update(
        rounds=rounds,
        summary=summary,
        kvcr_stats_before=before[-1] if before else None,
        kvcr_stats_after=after,
        kvcr_offloaded_during_phase=offloaded,
        offload_note="KVCR_STATS deltas from the last line before the phase (or "
        "startup) to the first line after it; the servers only run during their "
        "rounds (SIGSTOP otherwise), so these offloads happened in rounds",
    )
    error = None
    done_in_window = [r["background_done_in_window"] for r in rounds["kvcr"]]
    if offloaded is not None and offloaded["offloaded_bytes"] <= 0:
        error = "the kvcr server offloaded nothing during the decode rounds"
    elif 4 * sum(n > 0 for n in done_in_window) < 3 * len(done_in_window):
        error = (
            "under 3/4 of the kvcr rounds had a background prefill finish inside "
            "their decode window"
        )
    common = {
        "samples": summary["kvcr"]["n"],
        "rounds": args.itl_rounds,
        "background_done_in_window": done_in_window,
        "offloaded_bytes_during_phase": None
        if offloaded is None
        else offloaded["offloaded_bytes"],
        "offload_failures_during_phase": None
        if offloaded is None
        else offloaded["offload_failures"],
    }
    metrics.extend(
        metric(
            f"decode_itl_{q}_ratio",
            summary["kvcr"][q],
            "ms",
            summary["none"][q],
            error=error,
            **common,
        )
        for q in ("p50", "p99")
    )


def bench_serving(
    args: argparse.Namespace, out: dict[str, Any], metrics: list[dict[str, Any]]
) -> None:
    """Every server up, one running at a time (the others SIGSTOPped), in rotating
    order per round of one fresh prompt each.

    Interleaving makes load from elsewhere hit every variant alike, and stopping
    the idle servers keeps their threads (KVCR's progress loop, for one) from
    taxing the others' samples. Rounds during which other processes used more
    than ``--quiet-round-busy`` of the CPUs are kept in the report but left out of the
    medians, and replaced, up to 4x the requested rounds.
    """
    from sglang.srt.mem_cache.storage.kvcr import integration

    rng = random.Random(args.seed + 3)
    model = str(ensure_tiny_model())

    def prompt() -> list[int]:
        return [rng.randrange(3, 300) for _ in range(args.ttft_prompt_len)]

    work = Path(out["_work"])
    base = [
        "--page-size",
        str(args.ttft_page_size),
        "--max-total-tokens",
        str(8 * args.ttft_prompt_len),
        "--max-running-requests",
        "4",
        "--chunked-prefill-size",
        str(max(args.ttft_prompt_len, 512)),
    ]
    linker_args = harness.kvcr_linker_args(
        kvcr_bench.kvcr_linker_config(256 * _MIB, 10000, {})
    )
    details: dict[str, Any] = {
        "prompt_len": args.ttft_prompt_len,
        "method": "streaming /generate, send -> first chunk; 1 output token; "
        "servers interleaved in rotating order, the idle ones SIGSTOPped; "
        "medians over rounds with little CPU use by other processes",
    }
    out["serving"] = details
    # The plugin selects SGLang's Python radix tree core; the default server runs
    # the Rust one. ``none_pytree`` separates that choice from the linker itself.
    variants = [
        ("none", [], None),
        *(
            []  # --quick: one server fewer to start on a small machine
            if args.quick
            else [("none_pytree", [], {integration.TREE_CORE_ENV: "python"})]
        ),
        ("kvcr", linker_args, None),
        *EXTRA_SERVING_VARIANTS,
    ]
    servers: dict[str, harness.ServerHandle] = {}
    rounds: list[dict[str, Any]] = []
    try:
        for name, extra, env in variants:
            servers[name] = harness.launch_server(
                base + extra,
                model_path=model,
                log_path=work / f"microbench_{name}.log",
                startup_timeout=args.startup_timeout,
                env=env,
                wait=False,
            )
        for handle in servers.values():
            handle.wait_ready(args.startup_timeout)
            kvcr_bench.pause(handle)
        try:
            bench_decode_itl(args, servers, details, metrics)
        except Exception as exc:
            traceback.print_exc()
            error = f"{type(exc).__name__}: {exc}"[:2000]
            metrics += [
                metric(n, None, "ms", error=error)
                for n in ("decode_itl_p50_ratio", "decode_itl_p99_ratio")
                if n not in {m["name"] for m in metrics}
            ]
            for handle in servers.values():
                kvcr_bench.pause(handle)
        meter = CpuMeter({h.pgid for h in servers.values()})
        names = list(servers)
        quiet = 0
        for i in range(args.ttft_warmup + 4 * args.ttft_prompts):
            if quiet >= args.ttft_prompts:
                break
            ids = prompt()
            # Rotate and reverse the order so no variant always runs first.
            k = i % len(names)
            order = names[k:] + names[:k]
            before = meter.snapshot()
            got: dict[str, Any] = {}
            for name in order if (i // len(names)) % 2 == 0 else order[::-1]:
                with kvcr_bench.running(servers[name]):
                    got[name] = kvcr_bench.stream_ttft(
                        servers[name], ids, 1, timeout=120.0
                    )
            if i < args.ttft_warmup:
                continue
            external = CpuMeter.external(before, meter.snapshot())
            quiet += external <= args.quiet_round_busy
            rounds.append({"external_busy": round(external, 3), "samples": got})
        for name, handle in servers.items():
            kvcr_bench.resume(handle)
            details[name] = {
                "startup_s": round(handle.startup_s or 0.0, 2),
                "log": str(handle.log_path),
            }
        details["kvcr"]["kvcr_stats"] = kvcr_bench.STATS_RE.findall(
            servers["kvcr"].log_text()
        )
    finally:
        for handle in servers.values():
            kvcr_bench.resume(handle)
            handle.stop()
    if any(s["cached_tokens"] for r in rounds for s in r["samples"].values()):
        raise RuntimeError("a 'unique' prompt was served from cache")
    used = [r for r in rounds if r["external_busy"] <= args.quiet_round_busy]
    details["rounds"] = len(rounds)
    details["quiet_rounds"] = len(used)
    details["noisy"] = len(used) < args.ttft_prompts
    if details["noisy"]:
        used = rounds  # never quiet enough: report every round, flagged
    for name in servers:
        details[name]["ttft_ms"] = [r["samples"][name]["ttft_ms"] for r in used]
        details[name]["all_ttft_ms"] = [r["samples"][name]["ttft_ms"] for r in rounds]
    details["external_busy"] = [r["external_busy"] for r in rounds]
    ttft = {n: details[n]["ttft_ms"] for n in servers}
    pair_ratios = [k / n for k, n in zip(ttft["kvcr"], ttft["none"], strict=True)]
    details["pair_ratio"] = dist(pair_ratios)
    med = {n: statistics.median(v) for n, v in ttft.items()}
    details["median_ttft_ms"] = {n: round(v, 3) for n, v in med.items()}
    details["p25_ttft_ms"] = {n: round(pct(v, 0.25), 3) for n, v in ttft.items()}
    pytree = med.get("none_pytree")
    details["ratio_python_tree_core_vs_none"] = (
        round(pytree / med["none"], 3) if pytree else None
    )
    details["ratio_kvcr_vs_python_tree_core"] = (
        round(med["kvcr"] / pytree, 3) if pytree else None
    )
    metrics.append(
        metric(
            "zero_hit_ttft_ratio",
            statistics.median(ttft["kvcr"]),
            "ms",
            statistics.median(ttft["none"]),
            samples=len(ttft["kvcr"]),
            with_linker_range_ms=[min(ttft["kvcr"]), max(ttft["kvcr"])],
            without_linker_range_ms=[min(ttft["none"]), max(ttft["none"])],
            pair_ratio_p50=details["pair_ratio"]["p50"],
            vs_python_tree_core=details["ratio_kvcr_vs_python_tree_core"],
            quiet_rounds=details["quiet_rounds"],
            noisy=details["noisy"],
        )
    )


# ---- driver ------------------------------------------------------------------------

SECTIONS: tuple[tuple[str, Callable[..., None], tuple[str, ...]], ...] = (
    (
        "serving",
        bench_serving,
        ("decode_itl_p50_ratio", "decode_itl_p99_ratio", "zero_hit_ttft_ratio"),
    ),
    (
        "copy",
        bench_copy_and_prepare,
        (
            "offload_vs_nixl_loopback",
            "restore_copy_vs_torch_copy",
            "zero_hit_prepare_us_p50",
            "zero_hit_owner_commands",
            "hit_prepare_us_p50",
        ),
    ),
    ("hint", bench_hint, ("hint_prepare_us_p50",)),
    ("hooks", bench_hooks, ("linker_idle_cpu_pct", "hook_overhead_us_p50")),
    ("transfer", bench_transfer, ()),  # names per --transfer-pages, see main
)
PREPARE_METRICS = (
    "zero_hit_prepare_us_p50",
    "zero_hit_owner_commands",
    "hit_prepare_us_p50",
)
UNITS = {
    "zero_hit_ttft_ratio": "ms",
    "restore_copy_vs_torch_copy": "GB/s",
    "offload_vs_nixl_loopback": "GB/s",
    "zero_hit_owner_commands": "count",
    "linker_idle_cpu_pct": "% core",
    "decode_itl_p50_ratio": "ms",
    "decode_itl_p99_ratio": "ms",
}


def section_metrics(section: str, names: tuple[str, ...], args: argparse.Namespace):
    if section != "transfer":
        return names
    return tuple(
        f"{kind}_{n}p"
        for n in args.transfer_pages
        for kind in ("restore_vs_pinned_h2d", "offload_vs_pinned_d2h")
    )


def versions() -> dict[str, str]:
    out = {}
    for dist_name in ("sglang", "kvcr", "nixl", "torch"):
        try:
            out[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            out[dist_name] = "missing"
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    work = Path(args.report).parent if args.report else harness.cache_dir() / "bench"
    work.mkdir(parents=True, exist_ok=True)
    details: dict[str, Any] = {"_work": str(work)}
    # How busy the machine was when each section started (often a shared one).
    load: dict[str, dict[str, Any]] = {}
    metrics: list[dict[str, Any]] = []
    for section, run, names in SECTIONS:
        if section in args.skip:
            continue
        quiet = wait_for_quiet(args.quiet_busy, args.quiet_wait_s)
        load[section] = {**quiet, "loadavg": [round(x, 2) for x in os.getloadavg()]}
        t0 = time.monotonic()
        print(f"[bench] {section} (machine busy {quiet['busy']:.0%}) ...", flush=True)
        try:
            run(args, details, metrics)
        except Exception as exc:
            traceback.print_exc()
            error = f"{type(exc).__name__}: {exc}"[:2000]
            done = {m["name"] for m in metrics}
            skipped = PREPARE_METRICS if "prepare" in args.skip else ()
            metrics += [
                metric(
                    n,
                    None,
                    "GB/s" if section == "transfer" else UNITS.get(n, "us"),
                    error=error,
                    informational=section == "transfer" and args.device != "cuda",
                )
                for n in section_metrics(section, names, args)
                if n not in done and n not in skipped
            ]
        print(f"[bench] {section} done in {time.monotonic() - t0:.1f} s", flush=True)
    details.pop("_work")
    wall = time.monotonic() - started
    path = Path(args.report) if args.report else work / "kvcr_microbench_report.json"
    config = {
        k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()
    }
    body = {
        "metrics": metrics,
        "details": details,
        "config": config,
        "versions": versions(),
        "env": {
            k: os.environ.get(k, "")
            for k in ("UCX_NET_DEVICES", "UCX_TLS", "NIXL_LOG_LEVEL", "OMP_NUM_THREADS")
        },
        "cpus": os.cpu_count(),
        "machine_at_section_start": load,
        "wall_s": round(wall, 1),
    }
    path.write_text(json.dumps(body, indent=2))
    print()
    print(
        f"{'metric':<28} {'value':>10} {'unit':<6} {'baseline':>10} {'ratio':>7} "
        f"{'target':<16} result"
    )

    def fmt(x: Any) -> str:
        return "-" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)

    for m in metrics:
        result = {True: "PASS", False: "FAIL", None: "info"}[m["passed"]]
        print(
            f"{m['name']:<28} {fmt(m['value']):>10} {m['unit']:<6} "
            f"{fmt(m['baseline']):>10} {fmt(m['ratio']):>7} "
            f"{m['target'] or '-':<16} {result}"
            + (f"  ({m['error'][:80]})" if m.get("error") else "")
        )
    serving = details.get("serving", {})
    if "median_ttft_ms" in serving:
        split = (
            f" (python tree core alone: {serving['ratio_python_tree_core_vs_none']}x;"
            f" linker over it: {serving['ratio_kvcr_vs_python_tree_core']}x)"
            if serving["ratio_python_tree_core_vs_none"] is not None
            else ""
        )
        print(
            "serving median TTFT ms: "
            + ", ".join(f"{k}={v:.1f}" for k, v in serving["median_ttft_ms"].items())
            + split
        )
    itl = serving.get("decode_itl", {}).get("summary")
    if itl:
        moved = serving["decode_itl"]["kvcr_offloaded_during_phase"]
        print(
            "decode ITL ms (p50/p99): "
            + ", ".join(f"{k}={v['p50']}/{v['p99']}" for k, v in itl.items())
            + f"; kvcr offloaded during the rounds: {moved}"
        )
    for key, case in details.get("transfer", {}).items():
        if key.endswith("p") and isinstance(case, dict):
            med = {k: statistics.median(v) for k, v in case["gbps"].items()}
            print(
                f"transfer {key} ({args.device}) median GB/s: "
                + ", ".join(f"{k} {v:.2f}" for k, v in med.items())
                + f" ({case['seconds']} s)"
            )
    copy = details.get("copy", {})
    if "restore_scattered_gbps" in copy:
        print(
            "restore GB/s per rep: contiguous "
            f"{copy['restore_contiguous_gbps']}, scattered "
            f"{copy['restore_scattered_gbps']}; torch index_copy_ of uint8 rows "
            f"{copy['torch_index_copy_gbps']}"
        )
    ok = all(m["passed"] is not False for m in metrics)
    print(f"overall: {'PASS' if ok else 'FAIL'} in {wall:.1f} s")
    print(f"REPORT {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
