"""TP=2 on CPU: one server with ``--tp 2`` (two scheduler ranks over gloo, each
with its own KVCR). Compute, evict from the device, replay restored from KVCR on
both ranks, flush; outputs equal the server's own uncached run.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

from cpu_harness import server as harness
from cpu_harness.tiny_model import ensure_tiny_model
from kvcr_drivers.faults.common import Scenario
from kvcr_drivers.faults.soak import final_stats


def run_tp2(args: argparse.Namespace, work: Path) -> Scenario:
    sc = Scenario("tp2_end_to_end")
    started = time.monotonic()
    page, prompt_len, pool_tokens = 16, 256, 1024
    bind = "0|1" if (os.cpu_count() or 1) >= 2 else "0|0"
    handle = None
    try:
        handle = harness.launch_server(
            [
                "--tp",
                "2",
                "--page-size",
                str(page),
                "--max-total-tokens",
                str(pool_tokens),
                "--max-running-requests",
                "4",
                *harness.kvcr_linker_args(
                    {
                        "local_dram_bytes_per_worker": 64 << 20,
                        "operation_timeout_ms": 5000,
                        "abandon_timeout_ms": 10000,
                    }
                ),
            ],
            model_path=ensure_tiny_model(),
            log_path=work / "tp2.log",
            startup_timeout=args.startup_timeout,
            # SGLang binds one OpenMP core set per CPU rank; without this it asserts
            # ranks <= NUMA nodes (1 here).
            env={"SGLANG_CPU_OMP_THREADS_BIND": bind},
        )
        sc.details["startup_s"] = round(handle.startup_s or 0, 1)
        sc.details["SGLANG_CPU_OMP_THREADS_BIND"] = bind
        rng = random.Random(args.seed + 2)
        prompt = [rng.randrange(3, 300) for _ in range(prompt_len)]

        def gen(ids: list[int]) -> tuple[list[int], int, int]:
            res = handle.generate(input_ids=ids, max_new_tokens=8, timeout=120)
            d = res.get("meta_info", {}).get("cached_tokens_details") or {}
            return (
                list(res["output_ids"]),
                int(d.get("host", 0) or 0),
                int(d.get("device", 0) or 0),
            )

        control, _, _ = gen(prompt)  # uncached: the control
        for _ in range(2 * pool_tokens // prompt_len + 2):
            gen([rng.randrange(3, 300) for _ in range(prompt_len)])
        replay, external, device = gen(prompt)
        aligned = (prompt_len - 1) // page * page
        sc.details.update(
            {"external_tokens": external, "device_tokens": device, "aligned": aligned}
        )
        sc.check(
            "replay restored >= 90% of the prompt from KVCR", external >= 0.9 * aligned
        )
        sc.check(
            "replay output equals the uncached run", replay == control and bool(control)
        )
        flushed = handle.flush_cache().status_code == 200
        after, external2, device2 = gen(prompt)
        sc.check(
            "flush empties both ranks' KVCR",
            flushed and external2 == 0 and device2 == 0,
        )
        sc.check("output after flush equals the uncached run", after == control)
        sc.output_matches_control = replay == control and after == control
    except Exception as exc:
        sc.error = f"{type(exc).__name__}: {str(exc)[-3000:]}"
        sc.blocked = "Scheduler hit an exception" in str(exc) or "rc=" in str(exc)
    finally:
        if handle is not None:
            handle.stop()
    if handle is not None:
        finals = final_stats(handle.log_text())
        sc.details["ranks_reporting"] = len(finals)
        sc.details["final_stats"] = [
            {
                f: s.get(f)
                for f in (
                    "hit_pages",
                    "loads",
                    "claims_held",
                    "abandoned_bytes",
                    "offloads",
                )
            }
            for s in finals
        ]
        sc.check("both ranks ran a KVCR linker", len(finals) == 2)
        sc.check(
            "both ranks restored pages",
            len(finals) == 2 and all(s.get("hit_pages", 0) > 0 for s in finals),
        )
        sc.claims_leaked = sum(s.get("claims_held", 0) for s in finals)
        sc.check("no claims held at shutdown", sc.claims_leaked == 0 and bool(finals))
        sc.details["log"] = str(handle.log_path)
    sc.wall_s = time.monotonic() - started
    sc.outcome = (
        f"TP=2 replay restored {sc.details.get('external_tokens')} tokens on both ranks"
        if sc.passed
        else f"TP=2 failed: {sc.failed_checks() or sc.error[-200:]}"
    )
    return sc
