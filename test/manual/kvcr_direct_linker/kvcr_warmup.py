"""Warm-up for ``gpu_check.sh``: every model's server once, so later stages start warm.

Starts one KVCR-linker server per ``--models`` geometry, all at once
(``kvcr_drivers.bench.geometry_servers``: dummy weights, ``--load-format dummy``),
and sends each, once ready, a greedy request of ``--prompt-len`` tokens with
``--output-len`` output tokens and then the same prompt again (a device prefix
hit). On a GPU this pays the cold-start costs once, into the caches
``gpu_check.sh`` points under the work tree: SGLang's JIT kernels
(``store_cache``, ``concat_mla_k``: nvcc, into ``$SGLANG_JIT_CACHE_DIR``) and
Triton's compiles (``$TRITON_CACHE_DIR``) for prefill, prefix-hit prefill and
decode of each attention kind. On CPU (``--device cpu``, the dry run and the
emulated host) it is the check that a server starts with the linker and serves.

A server passes when it became ready within ``--startup-timeout``, both requests
returned ``--output-len`` tokens, and its log has the linker's page layout line.
Writes a JSON report (``--report``); the last line is ``REPORT <path>``; exits 1
when a server failed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import _paths  # noqa: F401  (the repository's test/ on sys.path)

from cpu_harness import geometry_models
from cpu_harness import server as harness
from kvcr_drivers import cli
from kvcr_drivers.bench import geometry_servers

LAYOUT_LINE = "KVCR page layout"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_run_options(p)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--scale", choices=geometry_models.SCALES, default="dry-run")
    p.add_argument("--models", default="qwen3", help="comma-separated: qwen3,mla,swa")
    p.add_argument("--page-size", type=int, default=16, help="qwen3's page size")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--server-args", default="", help="extra launch_server flags")
    args = p.parse_args(argv)
    args.models = cli.comma_list(p, "--models", args.models, geometry_models.KINDS)
    if not args.models:
        p.error("--models: choose at least one of qwen3,mla,swa")
    if args.prompt_len < 2 * args.page_size or args.output_len < 1:
        p.error("--prompt-len must cover two pages, --output-len be >= 1")
    return args


def launcher(kind: str, args: argparse.Namespace, work: Any) -> Any:
    page = args.page_size if kind == "qwen3" else geometry_servers.FAMILY_PAGE
    return lambda: geometry_servers.launch(
        kind,
        scale=args.scale,
        device=args.device,
        work=work,
        prompt_len=args.prompt_len,
        page=page,
        server_args=args.server_args.split(),
    )


def warm(kind: str, args: argparse.Namespace, work: Any) -> dict[str, Any]:
    """Start ``kind``'s server, send its two requests, stop it; what was seen."""
    out: dict[str, Any] = {"model": kind, "ok": False}
    try:
        server = geometry_servers.start(
            launcher(kind, args, work), args.startup_timeout
        )
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        out["log_tail"] = harness.tail(work / f"{kind}.log", 40)
        return out
    try:
        out["startup_s"] = round(server.startup_s, 2)
        rng = random.Random(args.seed)
        ids = [rng.randrange(3, 300) for _ in range(args.prompt_len)]
        for name in ("first_request_s", "prefix_hit_s"):
            started = time.monotonic()
            reply = server.generate(
                input_ids=ids,
                max_new_tokens=args.output_len,
                timeout=args.request_timeout,
            )
            out[name] = round(time.monotonic() - started, 2)
            out[f"{name[:-2]}_tokens"] = len(reply.get("output_ids") or [])
        out["cached_tokens"] = int(reply["meta_info"].get("cached_tokens", 0) or 0)
    except Exception as exc:  # reported per server; the others carry on
        out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
    finally:
        server.stop()
    out["linker_layout_logged"] = LAYOUT_LINE in server.log_text()
    out["ok"] = (
        "error" not in out
        and out.get("first_request_tokens") == args.output_len
        and out.get("prefix_hit_tokens") == args.output_len
        and out["linker_layout_logged"]
    )
    if not out["ok"] and "error" not in out:
        out["error"] = "wrong output length or no KVCR page layout line"
    if not out["ok"]:
        out["log_tail"] = server.log_tail(40)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = cli.work_dir(args, "kvcr_warmup")
    started = time.monotonic()
    geometry_servers.prepare(args.models, args.scale)
    with ThreadPoolExecutor(max_workers=len(args.models)) as pool:
        results = list(pool.map(lambda kind: warm(kind, args, work), args.models))
    wall = round(time.monotonic() - started, 2)
    for r in results:
        verdict = "ok" if r["ok"] else f"FAIL ({r.get('error')})"
        print(
            f"warmup {r['model']}: {verdict} startup {r.get('startup_s')} s, "
            f"first request {r.get('first_request_s')} s, prefix hit "
            f"{r.get('prefix_hit_s')} s (cached {r.get('cached_tokens')})"
        )
        if not r["ok"]:
            print(r.get("log_tail", ""))
    report = args.report or str(work / "kvcr_warmup.json")
    body = {"args": vars(args), "wall_s": wall, "servers": results}
    with open(report, "w") as f:
        json.dump(body, f, indent=2)
    print(f"REPORT {report}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
