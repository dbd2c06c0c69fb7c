"""Soak: two CPU SGLang servers with the KVCR linker, mixed shared prefixes.

``--soak-requests`` requests over 48 shared prefixes with device and KVCR
evictions, a quarter of them carrying a ``kv.fetch`` hint naming the other
server. Greedy outputs of repeated prompts must agree; scheduler RSS at the start
(after warm-up) and end, and each linker's final claims and abandoned or
quarantined bytes (from its last ``KVCR_STATS`` line, logged at shutdown) are
recorded and checked.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import random
import re
import threading
import time
from pathlib import Path
from typing import Any

from cpu_harness import server as harness
from cpu_harness.kvcr_pages import fetch_hint
from cpu_harness.tiny_model import ensure_tiny_model
from kvcr_drivers.faults.common import rss_mb


def scheduler_pids(handle: Any) -> list[int]:
    import psutil

    try:
        procs = psutil.Process(handle.process.pid).children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if "scheduler" in " ".join(proc.cmdline()) or "scheduler" in proc.name():
                out.append(proc.pid)
    return out


def stats_of(line: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)", line)}


def final_stats(log: str) -> list[dict[str, int]]:
    """The last KVCR_STATS line of each rank (TPn prefix), parsed."""
    last: dict[str, str] = {}
    for m in re.finditer(r"^.*?(TP\d+)?\] KVCR_STATS (.*)$", log, re.M):
        last[m.group(1) or "TP0"] = m.group(2)
    return [stats_of(last[k]) for k in sorted(last)]


def run_soak(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import page_hash_to_u64

    page = 16
    model = ensure_tiny_model()
    ctl = {"A": harness.free_port(), "B": harness.free_port()}
    endpoints = {k: f"tcp://127.0.0.1:{p}" for k, p in ctl.items()}
    servers: dict[str, Any] = {}
    out: dict[str, Any] = {"requests": 0, "passed": False}
    t0 = time.monotonic()
    try:
        for name in ("A", "B"):
            config = {
                "local_dram_bytes_per_worker": 1 << 20,  # 256 pages: KVCR evicts
                "control_port": ctl[name],
                "operation_timeout_ms": 5000,
                "abandon_timeout_ms": 10000,
                "preparation_timeout_ms": 5000,
            }
            servers[name] = harness.launch_server(
                [
                    "--page-size",
                    str(page),
                    "--max-total-tokens",
                    "2048",  # the device pool evicts
                    "--max-running-requests",
                    "8",
                    *harness.kvcr_linker_args(config),
                ],
                model_path=model,
                log_path=work / f"soak_{name}.log",
                wait=False,
            )
        for handle in servers.values():
            handle.wait_ready(args.startup_timeout)
        out["startup_s"] = round(time.monotonic() - t0, 1)
        rng = random.Random(args.seed)
        prefixes = [[rng.randrange(3, 300) for _ in range(6 * page)] for _ in range(48)]
        suffixes = [[rng.randrange(3, 300) for _ in range(page)] for _ in range(3)]
        prefix_hashes = [
            [
                page_hash_to_u64(x)
                for x in get_storage_hash_str(RadixKey(p), None, page_size=page)
            ]
            for p in prefixes
        ]
        outputs: dict[tuple[int, int], list[int]] = {}
        lock = threading.Lock()
        counters = {
            "mismatches": 0,
            "hinted": 0,
            "external_hits": 0,
            "hinted_hits": 0,
            "peer_hits": 0,
            "errors": 0,
        }
        errors: list[str] = []
        sent: dict[str, set[int]] = {"A": set(), "B": set()}  # prefixes per server

        def one(i: int) -> None:
            r = random.Random(args.seed * 1000003 + i)
            target = "A" if r.random() < 0.5 else "B"
            other = "B" if target == "A" else "A"
            pi, si = r.randrange(len(prefixes)), r.randrange(len(suffixes))
            extra: dict[str, Any] = {}
            hinted = r.random() < 0.25
            with lock:  # never sent here before: a hit can only come from the peer
                first_here = pi not in sent[target]
                sent[target].add(pi)
            if hinted:
                extra["kv_hints"] = fetch_hint(endpoints[other], prefix_hashes[pi])
            try:
                res = servers[target].generate(
                    input_ids=prefixes[pi] + suffixes[si],
                    max_new_tokens=4,
                    timeout=120,
                    **extra,
                )
            except Exception as exc:
                with lock:
                    counters["errors"] += 1
                    errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
                return
            ids = list(res.get("output_ids") or [])
            details = res.get("meta_info", {}).get("cached_tokens_details") or {}
            with lock:
                counters["hinted"] += hinted
                if int(details.get("host", 0) or 0) > 0:
                    counters["external_hits"] += 1
                    counters["hinted_hits"] += hinted
                    counters["peer_hits"] += hinted and first_here
                first = outputs.setdefault((pi, si), ids)
                if first != ids:
                    counters["mismatches"] += 1

        with concurrent.futures.ThreadPoolExecutor(args.soak_concurrency) as pool:
            list(pool.map(one, range(-args.soak_warmup, 0)))
        time.sleep(1.0)
        sched = {k: scheduler_pids(h) for k, h in servers.items()}
        rss_start = {k: sum(rss_mb(p) for p in pids) for k, pids in sched.items()}
        out["scheduler_pids"] = sched
        for key in counters:
            counters[key] = 0
        t1 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.soak_concurrency) as pool:
            list(pool.map(one, range(args.soak_requests)))
        out["soak_s"] = round(time.monotonic() - t1, 1)
        time.sleep(2.0)  # let offloads and releases of the last requests drain
        rss_end = {k: sum(rss_mb(p) for p in pids) for k, pids in sched.items()}
        out["requests"] = args.soak_requests
        out["warmup_requests"] = args.soak_warmup
        out["rss_start_mb"] = round(sum(rss_start.values()), 1)
        out["rss_end_mb"] = round(sum(rss_end.values()), 1)
        out["rss_per_server_mb"] = {
            k: [round(rss_start[k], 1), round(rss_end[k], 1)] for k in servers
        }
        out.update(counters)
        out["error_samples"] = errors[:5]
        out["distinct_prompts"] = len(outputs)
    finally:
        for handle in servers.values():
            handle.stop()
    logs = {k: h.log_text() for k, h in servers.items()}
    finals = {k: final_stats(text) for k, text in logs.items()}
    out["final_stats"] = {
        k: {
            f: s.get(f)
            for f in (
                "claims_held",
                "abandoned_bytes",
                "hit_pages",
                "evicted_pages",
                "loads",
                "load_failures",
                "offload_failures",
                "prepared",
            )
        }
        for k, stats in finals.items()
        for s in stats[-1:]
    }
    out["claims_held_end"] = sum(
        s.get("claims_held", 0) for v in finals.values() for s in v
    )
    out["quarantined_bytes_end"] = sum(
        s.get("abandoned_bytes", 0) + s.get("quarantined_bytes", 0)
        for v in finals.values()
        for s in v
    )
    out["unclean_closes"] = sum(t.count("close was not clean") for t in logs.values())
    out["tracebacks"] = sum(t.count("Traceback") for t in logs.values())
    out["logs"] = {k: str(h.log_path) for k, h in servers.items()}
    rss_ok = (
        all(rss_end[k] <= 1.2 * rss_start[k] for k in servers)
        if out.get("rss_start_mb")
        else False
    )
    out["checks"] = {
        "rss end <= 1.2 x start (each server)": rss_ok,
        "0 claims held at the end": out["claims_held_end"] == 0
        and all(finals.values()),
        "0 abandoned/quarantined bytes at the end": out["quarantined_bytes_end"] == 0,
        "every request completed": out.get("errors", 1) == 0,
        "repeated prompts give identical greedy outputs": out.get("mismatches", 1) == 0,
        "external (KVCR) hits happened": out.get("external_hits", 0) > 0,
        "hinted peer hits happened (prefix never sent to that server)": out.get(
            "peer_hits", 0
        )
        > 0,
        "KVCR evicted pages (pressure reached)": any(
            (s.get("evicted_pages") or 0) > 0 for s in out["final_stats"].values()
        ),
        "no unclean KVCR close, no traceback": out["unclean_closes"] == 0
        and out["tracebacks"] == 0,
    }
    out["passed"] = all(out["checks"].values())
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out
