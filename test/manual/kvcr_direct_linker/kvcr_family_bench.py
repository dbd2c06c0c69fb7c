"""MLA and sliding-window serving with the KVCR linker: evict, replay, compare.

For each ``--families`` model (``mla``: DeepSeek-V2-Lite's attention geometry,
``swa``: a hybrid sliding-window model; ``cpu_harness.geometry_models``, served
with ``--load-format dummy`` and fan-in-scaled dummy weights), one KVCR-linker
server, all started at once. Each runs ``kvcr_servers.family_round_trip``: a
prompt computed and written through to KVCR, filler prompts that evict it from the
device pool, the prompt replayed, then ``/flush_cache`` and the prompt recomputed.
The replay must be a real KVCR hit (every aligned token restored from KVCR, none
from the device) whose greedy output equals the recompute's and whose logprobs
are within ``--logprob-tol`` of them (default: 1e-4 on CPU, 5e-2 on CUDA, where
prefill with a restored prefix and full prefill take different bf16 kernels), on
logits that are not uniform; the linker must log the family and a page layout
equal to the geometry, and restore exactly the expected bytes (SWA: only the
window's pages). ``--scale full`` on the GPU, ``dry-run`` (scaled down) on CPU.

Writes a JSON report (``--report``; last line ``REPORT <path>``); exits 1 when a
check failed or a server did not start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import _paths  # noqa: F401  (the repository's test/ on sys.path)

from cpu_harness import geometry_models, kvcr_servers
from cpu_harness import server as harness
from kvcr_drivers import cli
from kvcr_drivers.bench import geometry_servers

FAMILIES = ("mla", "swa")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_run_options(p)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--scale", choices=geometry_models.SCALES, default="dry-run")
    p.add_argument("--families", default="mla,swa", help="comma-separated: mla,swa")
    p.add_argument("--prompt-len", type=int, default=kvcr_servers.FAMILY_PROMPT_LEN)
    p.add_argument("--logprob-tol", type=float, default=None)
    p.add_argument("--server-args", default="", help="extra launch_server flags")
    args = p.parse_args(argv)
    args.families = cli.comma_list(p, "--families", args.families, FAMILIES)
    if not args.families:
        p.error("--families: choose at least one of mla,swa")
    if args.prompt_len < 4 * geometry_servers.FAMILY_PAGE:
        p.error("--prompt-len must cover four pages")
    if args.logprob_tol is None:
        args.logprob_tol = 5e-2 if args.device == "cuda" else 1e-4
    return args


def round_trip(family: str, args: argparse.Namespace, work: Any) -> dict[str, Any]:
    """One family's server and round trip, and its checks (stopped after)."""

    def launch() -> Any:
        return geometry_servers.launch(
            family,
            scale=args.scale,
            device=args.device,
            work=work,
            prompt_len=args.prompt_len,
            server_args=args.server_args.split(),
        )

    try:
        server = geometry_servers.start(launch, args.startup_timeout)
    except Exception as exc:
        return {
            "family": family,
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500],
            "log_tail": harness.tail(work / f"{family}.log", 40),
        }
    try:
        replay = kvcr_servers.family_round_trip(
            server, prompt_len=args.prompt_len, ready_s=args.startup_timeout
        )
    except Exception as exc:
        server.stop()
        return {
            "family": server.family,
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500],
            "log_tail": server.log_tail(40),
        }
    checks = replay.checks(logprob_tol=args.logprob_tol)
    body = dataclasses.asdict(replay)
    body.pop("log")
    return {
        "family": server.family,
        "ok": all(checks.values()),
        "checks": checks,
        "logprob_gap": round(replay.logprob_gap(), 3),
        "stats": replay.stats(),
        **body,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = cli.work_dir(args, "kvcr_family_bench")
    started = time.monotonic()
    geometry_servers.prepare(args.families, args.scale)
    with ThreadPoolExecutor(max_workers=len(args.families)) as pool:
        results = list(pool.map(lambda f: round_trip(f, args, work), args.families))
    for r in results:
        failed = [k for k, ok in r.get("checks", {}).items() if not ok]
        verdict = "ok" if r["ok"] else f"FAIL {failed or r.get('error')}"
        print(
            f"family {r['family']}: {verdict}; startup {r.get('startup_s')} s, "
            f"round trip {r.get('wall_s')} s, restored "
            f"{r.get('stats', {}).get('restored_bytes')} bytes"
        )
        if not r["ok"] and "log_tail" in r:
            print(r["log_tail"])
    report = args.report or str(work / "kvcr_family_bench.json")
    body = {
        "args": vars(args),
        "wall_s": round(time.monotonic() - started, 2),
        "families": results,
    }
    with open(report, "w") as f:
        json.dump(body, f, indent=2, default=str)
    print(f"REPORT {report}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
