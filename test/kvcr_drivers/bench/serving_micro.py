"""(e) zero-hit streaming TTFT, (e') decode ITL under write-through load, and
(g)/(h) the replay of an evicted prompt from KVCR and the write-through of that
traffic (``serving_replay``), on CPU servers with and without the KVCR linker, run
side by side (one at a time, the others SIGSTOPped, in rotating order)."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

from cpu_harness import server as harness
from cpu_harness.server import REPO
from cpu_harness.tiny_model import ensure_tiny_model
from kvcr_drivers.bench import decode_itl, serving, serving_replay, zero_hit_stages
from kvcr_drivers.bench.metrics import (
    cpu_ticks,
    dist,
    machine_cpu_ticks,
    metric,
    pct,
    proc_stat,
    ratio_ci,
    ratio_of_medians,
)
from kvcr_drivers.bench.pools import MIB

TWIN = "_twin"  # the name suffix of an arm's second server
TWINNED_ARMS = ("none", "kvcr")  # the arms the zero-hit target compares
EXTRA_SERVING_VARIANTS: list[tuple[str, list[str], dict[str, str] | None]] = []


class CpuMeter:
    """Splits machine CPU time into ours (this process and the server groups) and
    everyone else's, from /proc, so rounds disturbed by other work can be told."""

    def __init__(self, pgids: set[int]) -> None:
        self.pgids = pgids
        self.me = os.getpid()

    def _own(self) -> int:
        ticks = 0
        for entry in os.listdir("/proc"):
            fields = proc_stat(f"/proc/{entry}/stat") if entry.isdigit() else None
            if fields is None:
                continue
            if int(entry) == self.me or int(fields[2]) in self.pgids:
                ticks += cpu_ticks(fields)
        return ticks

    def snapshot(self) -> tuple[int, int, int]:
        cpu = machine_cpu_ticks()
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
    alternating order (one server running at a time). SGLang's linker mode
    (the null linker), when that control server runs, decodes the same rounds:
    its figures are in the summary, not in the metrics."""
    page = args.ttft_page_size
    vocab = 300
    fg = decode_itl.prompt_maker(args.seed + 40, 48, vocab)
    arms = ("none", "kvcr", "null_linker")
    runs = {name: servers[name] for name in arms if name in servers}
    itl: dict[str, Any] = {
        "method": decode_itl.__doc__,
        "background_prompt_len": args.ttft_prompt_len,
        "background_pages_per_prompt": serving.page_aligned(args.ttft_prompt_len, page)
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
            with serving.running(runs[name]):
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
    with serving.running(runs["kvcr"]):
        before = [
            x
            for x in decode_itl.stamped_stats(runs["kvcr"].log_text())
            if x[0] < _stamp(started)
        ]
        after = stats_after(runs["kvcr"], ended + 1.0, args.itl_stats_wait_s)
    offloaded = None
    if after is not None:
        first = serving.parse_stats(before[-1][1]) if before else {}
        last = serving.parse_stats(after[1])
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


def server_args(args: argparse.Namespace, max_total: int) -> list[str]:
    """Every serving server's arguments (``--enable-metrics`` only with
    ``--stage-split``)."""
    base = [
        "--page-size",
        str(args.ttft_page_size),
        "--max-total-tokens",
        str(max_total),
        "--max-running-requests",
        "4",
        "--chunked-prefill-size",
        str(serving.prefill_chunk(args.ttft_prompt_len, args.ttft_page_size)),
    ]
    if getattr(args, "stage_split", False):
        # SGLang's request timestamps, for where the zero-hit time goes
        # (zero_hit_stages). It also turns kvcr's own exporter on in its arm.
        base.append("--enable-metrics")
    return base


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
    from kvcr_drivers.bench import null_linker  # imports SGLang: not at module load
    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import integration

    rng = random.Random(args.seed + 3)
    model = str(ensure_tiny_model())

    def prompt() -> list[int]:
        return [rng.randrange(3, 300) for _ in range(args.ttft_prompt_len)]

    work = Path(out["_work"])
    max_total = 8 * args.ttft_prompt_len
    base = server_args(args, max_total)
    linker_args = harness.kvcr_linker_args(
        serving.kvcr_linker_config(256 * MIB, 10000, {})
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
    python_tree = {integration.TREE_CORE_ENV: "python"}
    # SGLang's linker mode with a linker that does nothing (``null_linker``):
    # what the linker mode itself costs, apart from what kvcr adds.
    linker_mode = [
        "--enable-unified-cache-external-linker",
        "--unified-cache-external-linker-backend",
        "dynamic",
        "--unified-cache-external-linker-config",
        json.dumps(null_linker.launch_config()),
    ]
    variants = [
        ("none", [], None),
        *(
            []  # --quick: fewer servers to start on a small machine
            if args.quick
            else [
                ("none_pytree", [], python_tree),
                (
                    "null_linker",
                    linker_mode,
                    {**python_tree, "PYTHONPATH": str(REPO / "test")},
                ),
            ]
        ),
        ("kvcr", linker_args, None),
        *EXTRA_SERVING_VARIANTS,
    ]
    if not args.quick:
        # A second server each of the two arms the target compares. Two servers
        # of one configuration differ by up to 5-7% in median cold TTFT on a
        # 2-core host, an offset that outlasts a run's rounds (not memory layout
        # or hash seed: see the docs), so more rounds do not average it out; the
        # ratio uses both of each, and their spread is reported
        # (``instance_spread``).
        variants += [(n + TWIN, a, e) for n, a, e in variants if n in TWINNED_ARMS]
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
        for name, handle in list(servers.items()):
            try:
                handle.wait_ready(args.startup_timeout)
            except harness.ServerStartError as exc:
                if name in ("none", "kvcr"):
                    raise
                # A control server that failed costs its own ratio, not the section.
                print(f"[bench] control server {name} did not start: {exc}"[:2000])
                details.setdefault("control_start_errors", {})[name] = str(exc)[:2000]
                handle.stop()
                del servers[name]
                continue
            serving.pause(handle)
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
                serving.pause(handle)
        try:
            serving_replay.bench_replay(args, servers, max_total, details, metrics)
        except Exception as exc:
            traceback.print_exc()
            error = f"{type(exc).__name__}: {exc}"[:2000]
            metrics += [
                metric(n, None, u, error=error)
                for n, u in serving_replay.UNITS.items()
                if n not in {m["name"] for m in metrics}
            ]
            for handle in servers.values():
                serving.pause(handle)
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
                with serving.running(servers[name]):
                    got[name] = serving.stream_ttft(
                        servers[name], ids, 1, timeout=120.0
                    )
            if i < args.ttft_warmup:
                continue
            external = CpuMeter.external(before, meter.snapshot())
            quiet += external <= args.quiet_round_busy
            rounds.append({"external_busy": round(external, 3), "samples": got})
        for name, handle in servers.items():
            serving.resume(handle)
            details[name] = {
                "startup_s": round(handle.startup_s or 0.0, 2),
                "log": str(handle.log_path),
            }
        details["kvcr"]["kvcr_stats"] = serving.STATS_RE.findall(
            servers["kvcr"].log_text()
        )
    finally:
        for handle in servers.values():
            serving.resume(handle)
            handle.stop()
    zero_hit_details(args, details, rounds, list(servers), metrics)


def zero_hit_details(
    args: argparse.Namespace,
    details: dict[str, Any],
    rounds: list[dict[str, Any]],
    names: list[str],
    metrics: list[dict[str, Any]],
) -> None:
    """The TTFT samples of every round (``{"external_busy", "samples": {variant:
    stream_ttft(...)}}``) into ``details`` per variant, the medians over the quiet
    rounds, and the ``zero_hit_ttft_ratio`` metric."""
    if any(s["cached_tokens"] for r in rounds for s in r["samples"].values()):
        raise RuntimeError("a 'unique' prompt was served from cache")
    used = [r for r in rounds if r["external_busy"] <= args.quiet_round_busy]
    details["rounds"] = len(rounds)
    details["quiet_rounds"] = len(used)
    details["noisy"] = len(used) < args.ttft_prompts
    if details["noisy"]:
        used = rounds  # never quiet enough: report every round, flagged
    for name in names:
        arm = details.setdefault(name, {})
        arm["ttft_ms"] = [r["samples"][name]["ttft_ms"] for r in used]
        arm["all_ttft_ms"] = [r["samples"][name]["ttft_ms"] for r in rounds]
    details["external_busy"] = [r["external_busy"] for r in rounds]
    ttft = {n: details[n]["ttft_ms"] for n in names}
    # The target's two arms: each round's mean of an arm's two servers when
    # both ran (the control ratios below stay per server).
    twinned = all(n + TWIN in ttft for n in TWINNED_ARMS)
    arm = {
        n: [(a + b) / 2 for a, b in zip(ttft[n], ttft[n + TWIN], strict=True)]
        if twinned
        else ttft[n]
        for n in TWINNED_ARMS
    }
    if twinned:
        details["instance_spread"] = {
            n: round(ratio_of_medians(ttft[n + TWIN], ttft[n]), 4) for n in arm
        }
        details["median_ttft_ms_both_servers"] = {
            n: round(statistics.median(v), 3) for n, v in arm.items()
        }
    pair_ratios = [k / n for k, n in zip(arm["kvcr"], arm["none"], strict=True)]
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
    linker_mode = med.get("null_linker")
    details["ratio_sglang_linker_mode_vs_none"] = (
        round(linker_mode / med["none"], 3) if linker_mode else None
    )
    details["ratio_kvcr_vs_sglang_linker_mode"] = (
        round(med["kvcr"] / linker_mode, 3) if linker_mode else None
    )
    metrics.append(
        metric(
            "zero_hit_ttft_ratio",
            statistics.median(arm["kvcr"]),
            "ms",
            statistics.median(arm["none"]),
            samples=len(arm["kvcr"]),
            with_linker_range_ms=[min(arm["kvcr"]), max(arm["kvcr"])],
            without_linker_range_ms=[min(arm["none"]), max(arm["none"])],
            pair_ratio_p50=details["pair_ratio"]["p50"],
            ratio_ci90=[round(x, 4) for x in ratio_ci(arm["kvcr"], arm["none"])],
            vs_python_tree_core=details["ratio_kvcr_vs_python_tree_core"],
            vs_sglang_linker_mode=details["ratio_kvcr_vs_sglang_linker_mode"],
            servers_per_arm=2 if twinned else 1,
            single_server_ratio=round(ratio_of_medians(ttft["kvcr"], ttft["none"]), 4),
            instance_spread=details.get("instance_spread"),
            quiet_rounds=details["quiet_rounds"],
            noisy=details["noisy"],
        )
    )
    if getattr(args, "stage_split", False):
        zero_hit_stages.add_split(details, used, names, metrics)
