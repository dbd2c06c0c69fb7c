"""TP=2 on CPU: one server with ``--tp 2`` (two scheduler ranks over gloo).

``run_tp2`` serves the tiny Llama (MHA: each rank its own KVCR and its own
heads' pages); ``run_tp2_mla`` serves the tiny seeded-weight DeepSeek-V2 (MLA: a
rank-replicated pool, so only the owner rank runs KVCR and stores each page
once, and the follower receives the restored rows over the attention group).
Both compute, evict from the device, replay restored from KVCR, and compare the
outputs with the server's own uncached run; the MHA run also flushes.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path
from typing import Any

from cpu_harness import server as harness
from cpu_harness.tiny_family_models import ensure_family_model
from cpu_harness.tiny_model import ensure_tiny_model
from kvcr_drivers.faults.common import Scenario
from kvcr_drivers.faults.soak import final_stats

PAGE, PROMPT_LEN, POOL_TOKENS = 16, 256, 1024
DRAM_BYTES = 64 << 20
ALIGNED = (PROMPT_LEN - 1) // PAGE * PAGE


def _launch(args: argparse.Namespace, work: Path, model: Path, name: str) -> Any:
    # SGLang binds one OpenMP core set per CPU rank; without this it asserts
    # ranks <= NUMA nodes (1 here).
    bind = "0|1" if (os.cpu_count() or 1) >= 2 else "0|0"
    config = {
        "local_dram_bytes_per_worker": DRAM_BYTES,
        "operation_timeout_ms": 5000,
        "abandon_timeout_ms": 10000,
    }
    return harness.launch_server(
        [
            *("--tp", "2", "--page-size", str(PAGE)),
            *("--max-total-tokens", str(POOL_TOKENS), "--max-running-requests", "4"),
            *harness.kvcr_linker_args(config),
        ],
        model_path=model,
        log_path=work / f"{name}.log",
        startup_timeout=args.startup_timeout,
        env={"SGLANG_CPU_OMP_THREADS_BIND": bind},
    )


def _generate(handle: Any, ids: list[int]) -> tuple[list[int], int, int]:
    res = handle.generate(input_ids=ids, max_new_tokens=8, timeout=120)
    d = res.get("meta_info", {}).get("cached_tokens_details") or {}
    return (
        list(res["output_ids"]),
        int(d.get("host", 0) or 0),
        int(d.get("device", 0) or 0),
    )


def _replay(
    sc: Scenario, handle: Any, rng: random.Random
) -> tuple[list[int], list[int]]:
    """The uncached control, fillers that evict it from the device, then the
    replay: (control, replay) outputs; the replay is checked restored."""
    prompt = [rng.randrange(3, 300) for _ in range(PROMPT_LEN)]
    control, _, _ = _generate(handle, prompt)
    for _ in range(2 * POOL_TOKENS // PROMPT_LEN + 2):
        _generate(handle, [rng.randrange(3, 300) for _ in range(PROMPT_LEN)])
    replay, external, device = _generate(handle, prompt)
    sc.details.update(
        {"external_tokens": external, "device_tokens": device, "aligned": ALIGNED}
    )
    sc.check(
        "replay restored >= 90% of the prompt from KVCR", external >= 0.9 * ALIGNED
    )
    sc.check(
        "replay output equals the uncached run", replay == control and bool(control)
    )
    return prompt, control, replay


def _finish(
    sc: Scenario, handle: Any, started: float, what: str
) -> list[dict[str, int]]:
    finals = final_stats(handle.log_text()) if handle is not None else []
    if handle is not None:
        sc.details["ranks_reporting"] = len(finals)
        sc.claims_leaked = sum(s.get("claims_held", 0) for s in finals)
        sc.check("no claims held at shutdown", sc.claims_leaked == 0 and bool(finals))
        sc.details["log"] = str(handle.log_path)
    sc.wall_s = time.monotonic() - started
    sc.outcome = (
        f"TP=2 {what}: replay restored {sc.details.get('external_tokens')} tokens"
        if sc.passed
        else f"TP=2 {what} failed: {sc.failed_checks() or sc.error[-200:]}"
    )
    return finals


def _failed(sc: Scenario, exc: Exception) -> None:
    sc.error = f"{type(exc).__name__}: {str(exc)[-3000:]}"
    sc.blocked = "Scheduler hit an exception" in str(exc) or "rc=" in str(exc)


def run_tp2(args: argparse.Namespace, work: Path) -> Scenario:
    sc = Scenario("tp2_end_to_end")
    started, handle = time.monotonic(), None
    try:
        handle = _launch(args, work, ensure_tiny_model(), "tp2")
        sc.details["startup_s"] = round(handle.startup_s or 0, 1)
        prompt, control, replay = _replay(sc, handle, random.Random(args.seed + 2))
        flushed = handle.flush_cache().status_code == 200
        after, external2, device2 = _generate(handle, prompt)
        sc.check(
            "flush empties both ranks' KVCR",
            flushed and external2 == 0 and device2 == 0,
        )
        sc.check("output after flush equals the uncached run", after == control)
        sc.output_matches_control = replay == control and after == control
    except Exception as exc:
        _failed(sc, exc)
    finally:
        if handle is not None:
            handle.stop()
    finals = _finish(sc, handle, started, "MHA")
    if handle is not None:
        keys = ("hit_pages", "loads", "claims_held", "abandoned_bytes", "offloads")
        sc.details["final_stats"] = [{f: s.get(f) for f in keys} for s in finals]
        sc.check("both ranks ran a KVCR linker", len(finals) == 2)
        sc.check(
            "both ranks restored pages",
            len(finals) == 2 and all(s.get("hit_pages", 0) > 0 for s in finals),
        )
    return sc


def run_tp2_mla(args: argparse.Namespace, work: Path) -> Scenario:
    """TP=2 MLA: the owner rank alone deposits (each page once), the follower
    holds no KVCR DRAM and receives exactly the pages the owner restored."""
    sc = Scenario("tp2_mla_stored_once")
    started, handle = time.monotonic(), None
    try:
        root = harness.cache_dir() / "family-models"  # shared with the demo's
        model = ensure_family_model("mla", root / "mla", weights=True)
        handle = _launch(args, work, model, "tp2_mla")
        sc.details["startup_s"] = round(handle.startup_s or 0, 1)
        _, control, replay = _replay(sc, handle, random.Random(args.seed + 3))
        sc.output_matches_control = replay == control
    except Exception as exc:
        _failed(sc, exc)
    finally:
        if handle is not None:
            handle.stop()
    finals = _finish(sc, handle, started, "MLA stored once")
    if handle is not None:
        keys = (
            "offload_pages",
            "resident_keys",
            "dram_bytes",
            "load_pages",
            "replica_pages_sent",
            "replica_pages_received",
        )
        sc.details["final_stats"] = [{f: s.get(f) for f in keys} for s in finals]
        owner = finals[0] if len(finals) == 2 else {}
        follower = finals[1] if len(finals) == 2 else {}
        sc.check("both ranks report", len(finals) == 2)
        sc.check(
            "only the owner deposits pages (each page once)",
            owner.get("offload_pages", 0) > 0
            and owner.get("resident_keys", 0) > 0
            and follower.get("offload_pages", -1) == 0
            and follower.get("resident_keys", -1) == 0,
        )
        sc.check(
            "the follower holds no KVCR DRAM; the owner keeps the whole share",
            follower.get("dram_bytes", -1) == 0
            and owner.get("dram_bytes", 0) > DRAM_BYTES // 2,
        )
        sc.check(
            "the follower received exactly the pages the owner restored",
            0
            < owner.get("load_pages", 0)
            == owner.get("replica_pages_sent", -1)
            == follower.get("replica_pages_received", -2),
        )
    return sc
