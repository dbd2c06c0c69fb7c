"""The microbench's sections in order, the metric names each one reports, and the
report: a JSON file with a top-level ``metrics`` list and a printed table."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcr_drivers.bench import plot, serving_replay
from kvcr_drivers.bench.copy_prepare import bench_copy_and_prepare
from kvcr_drivers.bench.hint_hooks import bench_hint, bench_hooks
from kvcr_drivers.bench.metrics import metric, target_of, wait_for_quiet
from kvcr_drivers.bench.serving import STAGES
from kvcr_drivers.bench.serving_micro import bench_serving
from kvcr_drivers.bench.transfer import bench_transfer
from kvcr_drivers.bench.zero_hit_stages import NAME as NAME_BY_PARTS

SECTION_NAMES = ("serving", "copy", "prepare", "hint", "hooks", "transfer")
# Skipped unless --skip says otherwise: on cuda every section but transfer (the
# others measure CPU pools, CPU-side calls or the tiny CPU model, the same on any
# host; kvcr_bench.py is the GPU serving bench).
DEFAULT_TRANSFER = {"cpu": "47,256", "cuda": "47,256"}
DEFAULT_SKIP = {"cpu": "", "cuda": "serving,copy,prepare,hint,hooks"}
TRANSFER_KINDS = (
    "restore_vs_pinned_h2d",
    "offload_vs_pinned_d2h",
    "offload_vs_polled_d2h",
)
SECTIONS: tuple[tuple[str, Callable[..., None], tuple[str, ...]], ...] = (
    (
        "serving",
        bench_serving,
        (
            "decode_itl_p50_ratio",
            "decode_itl_p99_ratio",
            "replay_ttft_vs_device_hit",
            "replay_ttft_vs_recompute",
            "write_through_pages_per_s",
            "write_through_refusals",
            "write_through_back_to_back",
            "zero_hit_ttft_ratio",
        ),
    ),
    (
        "copy",
        bench_copy_and_prepare,
        (
            "offload_vs_nixl_loopback",
            "restore_copy_vs_torch_copy",
            "zero_hit_prepare_us_p50",
            "zero_hit_owner_commands",
            "hit_not_ready_at_once",
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
    "hit_not_ready_at_once",
    "hit_prepare_us_p50",
)
UNITS = {
    "zero_hit_ttft_ratio": "ms",
    "zero_hit_ttft_ratio_outside_forward": "ms",
    "restore_copy_vs_torch_copy": "GB/s",
    "offload_vs_nixl_loopback": "GB/s",
    "zero_hit_owner_commands": "count",
    "hit_not_ready_at_once": "count",
    "linker_idle_cpu_pct": "% core",
    "decode_itl_p50_ratio": "ms",
    "decode_itl_p99_ratio": "ms",
    **serving_replay.UNITS,
}


def section_metrics(section: str, names: tuple[str, ...], args: argparse.Namespace):
    if section == "serving" and getattr(args, "stage_split", False):
        return (*names, NAME_BY_PARTS)  # a failed section reports it too
    if section != "transfer":
        return names
    return tuple(f"{kind}_{n}p" for n in args.transfer_pages for kind in TRANSFER_KINDS)


def metric_names(device: str = "cpu") -> list[str]:
    """The metrics a run with the default sections and sizes on ``device``
    reports, in report order."""
    skip = set(filter(None, DEFAULT_SKIP[device].split(",")))
    args = argparse.Namespace(
        transfer_pages=[int(x) for x in DEFAULT_TRANSFER[device].split(",")]
    )
    return [
        n
        for section, _, names in SECTIONS
        if section not in skip
        for n in section_metrics(section, names, args)
        if not ("prepare" in skip and n in PREPARE_METRICS)
    ]


def metric_unit(name: str) -> str:
    return "GB/s" if name.startswith(TRANSFER_KINDS) else UNITS.get(name, "us")


def informational(name: str, device: str) -> bool:
    """Reported without a target on ``device``."""
    return target_of(name, device) is None


def versions() -> dict[str, str]:
    out = {}
    for dist_name in ("sglang", "kvcr", "nixl", "torch"):
        try:
            out[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            out[dist_name] = "missing"
    return out


def run_sections(
    args: argparse.Namespace, work: Path
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, dict[str, Any]]]:
    """Every section not in ``args.skip``, in order: (metrics, details, the machine's
    load at each section's start). A section that raises reports its metrics
    with the error."""
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
                    metric_unit(n),
                    error=error,
                    informational=informational(n, args.device),
                )
                for n in section_metrics(section, names, args)
                if n not in done and n not in skipped
            ]
        print(f"[bench] {section} done in {time.monotonic() - t0:.1f} s", flush=True)
    details.pop("_work")
    return metrics, details, load


def report(
    args: argparse.Namespace,
    work: Path,
    metrics: list[dict[str, Any]],
    details: dict[str, Any],
    load: dict[str, dict[str, Any]],
    wall: float,
) -> int:
    """Write the JSON report, print the table and summaries; 0 when no metric
    missed its target."""
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
    picture = plot.write_png(body, path)  # beside the JSON; never raises
    print()
    width = max([28, *(len(m["name"]) for m in metrics)])
    print(
        f"{'metric':<{width}} {'value':>10} {'unit':<6} {'baseline':>10} {'ratio':>7} "
        f"{'target':<16} result"
    )

    def fmt(x: Any) -> str:
        return "-" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)

    for m in metrics:
        result = {True: "PASS", False: "FAIL", None: "info"}[m["passed"]]
        print(
            f"{m['name']:<{width}} {fmt(m['value']):>10} {m['unit']:<6} "
            f"{fmt(m['baseline']):>10} {fmt(m['ratio']):>7} "
            f"{m['target'] or '-':<16} {result}"
            + (f"  ({m['error'][:80]})" if m.get("error") else "")
        )
    serving = details.get("serving", {})
    if "median_ttft_ms" in serving:
        split = (
            f" (python tree core alone: {serving['ratio_python_tree_core_vs_none']}x;"
            f" SGLang's linker mode, null linker: "
            f"{serving.get('ratio_sglang_linker_mode_vs_none')}x;"
            f" kvcr over it: {serving.get('ratio_kvcr_vs_sglang_linker_mode')}x)"
            if serving["ratio_python_tree_core_vs_none"] is not None
            else ""
        )
        print(
            "serving median TTFT ms: "
            + ", ".join(f"{k}={v:.1f}" for k, v in serving["median_ttft_ms"].items())
            + split
        )
        labels = {
            "zero_hit_ttft_ratio": "zero-hit TTFT ratio",
            "replay_ttft_vs_device_hit": "replay TTFT vs device hit",
        }
        for m in metrics:
            if m["name"] in labels and m.get("ratio_ci90"):
                low, high = m["ratio_ci90"]
                print(
                    f"{labels[m['name']]} {m['ratio']}, 90% bootstrap interval "
                    f"over its {m['samples']} rounds [{low}, {high}]"
                    + (" (noisy: every round, busy ones too)" if m.get("noisy") else "")
                )
        parts = next((m for m in metrics if m["name"] == NAME_BY_PARTS), {})
        if parts.get("stages"):
            print(
                "zero-hit added ms by stage (paired medians): "
                + ", ".join(f"{k}={v}" for k, v in parts["stages"].items())
                + f"; outside the forward {parts['added_ms']} ms, ratio "
                f"{parts['ratio']} {parts['ratio_ci90']} (by parts, not the target)"
            )
        over_mode = serving.get("stages_vs_sglang_linker_mode")
        if over_mode:
            print(
                "  of it over SGLang's linker mode (null linker), ms: "
                + ", ".join(
                    f"{k}={over_mode[k]['added_ms']}"
                    for k in (*STAGES, "outside_forward")
                )
            )
    itl = serving.get("decode_itl", {}).get("summary")
    if itl:
        moved = serving["decode_itl"]["kvcr_offloaded_during_phase"]
        print(
            "decode ITL ms (p50/p99): "
            + ", ".join(f"{k}={v['p50']}/{v['p99']}" for k, v in itl.items())
            + f"; kvcr offloaded during the rounds: {moved}"
        )
    replay = serving.get("replay", {})
    if replay.get("rounds"):
        used = [r["samples"] for r in replay["rounds"] if not r["warmup"]] or [{}]
        med = {
            label: statistics.median(s[name][kind]["ttft_ms"] for s in used)
            for label, name, kind in (
                ("kvcr device hit", "kvcr", "hit"),
                ("kvcr replay from KVCR", "kvcr", "replay"),
                ("none recompute", "none", "replay"),
            )
            if all(name in s for s in used)
        }
        print(
            "replay TTFT ms (medians): "
            + ", ".join(f"{k}={v:.1f}" for k, v in med.items())
            + f"; kvcr ran {replay['kvcr_running_s']} s in these rounds"
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
    print(picture.line())
    ok = all(m["passed"] is not False for m in metrics)
    print(f"overall: {'PASS' if ok else 'FAIL'} in {wall:.1f} s")
    print(f"REPORT {path}")
    return 0 if ok else 1
