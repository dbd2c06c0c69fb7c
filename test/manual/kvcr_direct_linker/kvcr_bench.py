"""Serving benchmark: TTFT with no external cache, SGLang HiCache, and the KVCR linker.

Runs one real SGLang server per configuration on this machine and sends every
configuration the same prompts:

* ``none``: radix cache only (no external tier);
* ``hicache``: ``--enable-hierarchical-cache`` with a host tier sized by
  ``--hicache-ratio`` / ``--hicache-size``;
* ``kvcr``: the KVCR direct linker (``--unified-cache-external-linker-backend kvcr``).

Workloads, repeated ``--reps`` times: ``zero_hit`` (unique prompts, nothing to
reuse), ``evict_replay`` (a seed prompt, filler traffic that cycles the small
device pool, then the seed again) and ``decode_itl`` (``--itl-rounds`` rounds
spread over the reps: one streaming request decodes ``--itl-output-len`` tokens
while unique ``--prompt-len`` prompts arrive, one per ``--itl-every-tokens`` of
its output, whose prefills make the KVCR linker write pages through; per-token
inter-token latency p50/p99 against ``none`` under the same load;
``kvcr_drivers/bench/decode_itl.py`` says what a sample is). TTFT is the time from
sending a streaming ``/generate`` (``"stream": true``) to receiving its first chunk.
On CPU the servers run side by side, one active at a time (the others SIGSTOPped), taking
turns rep by rep, so load from elsewhere on a shared machine hits each alike; on
GPU they run one after another. Every sample is kept in the JSON report with the
cached-token split the server reported. A configuration whose server does not
start (HiCache on the CPU server, for one) is recorded as skipped with the
exception line from its log. KVCR restore and offload bandwidth are not derivable
from serving (``KVCR_STATS`` lines carry bytes and counts, not copy durations);
the lines are recorded and ``make bench`` measures bandwidth.

The last line is ``REPORT <path>``; a PNG of every TTFT sample per configuration
lies beside the JSON (``kvcr_drivers/bench/plot.py``; matplotlib, the ``plot``
extra). Exits non-zero when a configuration that was not a known skip fails, or
when a KVCR replay is not served from KVCR.

CPU (default): the project's tiny offline model. GPU: ``--device cuda --model-path
Qwen/Qwen3-0.6B --page-size 64 --prompt-len 3000 --output-len 1`` plus backend
flags in ``--server-args``.

``decode_itl`` checks that KVCR really wrote through during the foreground
decodes: background prefills finished inside every kvcr window, and the kvcr
server's KVCR_STATS count an offload for each background prompt (none failed).

The workloads live in ``test/kvcr_drivers/bench/serving_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import sys

import _paths  # noqa: F401  (the repository's test/ on sys.path)

from kvcr_drivers import cli
from kvcr_drivers.bench.serving import add_server_options, check_server_options
from kvcr_drivers.bench.serving_bench import Bench

CONFIGS = ("none", "hicache", "kvcr")
WORKLOADS = ("zero_hit", "evict_replay", "decode_itl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_options(p, prompt_len=1024, output_len=1)
    cli.add_run_options(p)
    p.add_argument("--reps", type=int, default=5)
    cli.add_itl_options(
        p, rounds=5, rounds_help="decode_itl rounds per config, spread over the reps"
    )
    p.add_argument("--itl-fg-prompt-len", type=int, default=64)
    p.add_argument("--zero-hit-per-rep", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3, help="warm-up requests per server")
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated subset of {','.join(CONFIGS)}",
    )
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated subset of {','.join(WORKLOADS)}",
    )
    p.add_argument(
        "--hicache-ratio",
        type=float,
        default=4.0,
        help="host pool / device pool for the hicache config (must hold the "
        "seed plus fillers, or the replay misses the host tier too)",
    )
    p.add_argument(
        "--hicache-size", type=int, default=0, help="GB; overrides the ratio"
    )
    p.add_argument(
        "--dram-bytes",
        type=int,
        default=0,
        help="KVCR local_dram_bytes_per_worker (default 256 MiB on cpu, 8 GiB on "
        "cuda: enough for the seed plus every filler)",
    )
    p.add_argument(
        "--linker-config",
        default="",
        help="JSON object merged over the KVCR linker config",
    )
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument(
        "--stats-wait-s",
        type=float,
        default=40.0,
        help="after the kvcr workload, wait up to this long for a KVCR_STATS line "
        "(logged every 30 s)",
    )
    p.add_argument(
        "--interleave",
        choices=("auto", "on", "off"),
        default="auto",
        help="run every server at once, one active at a time (others SIGSTOPped), "
        "configurations taking turns per rep (auto: on for cpu, off for cuda)",
    )
    args = p.parse_args(argv)
    for name, choices in (("configs", CONFIGS), ("workloads", WORKLOADS)):
        chosen = cli.comma_list(p, f"--{name}", getattr(args, name), choices)
        if not chosen:
            p.error(f"--{name}: choose at least one of {list(choices)}")
        setattr(args, name, chosen)
    check_server_options(p, args)
    cli.check_itl_options(p, args)
    if args.reps < 1 or args.zero_hit_per_rep < 1:
        p.error("--reps and --zero-hit-per-rep must be >= 1")
    if args.itl_fg_prompt_len < 1:
        p.error("--itl-fg-prompt-len must be >= 1")
    if args.warmup < 0 or args.filler_requests < 0 or args.dram_bytes < 0:
        p.error("--warmup, --filler-requests and --dram-bytes must be >= 0")
    if args.hicache_ratio <= 0 or args.hicache_size < 0:
        p.error("--hicache-ratio must be > 0 and --hicache-size >= 0")
    if args.stats_wait_s < 0:
        p.error("--stats-wait-s must be >= 0")
    if args.max_total_tokens and args.max_total_tokens < args.prompt_len + 64:
        p.error("--max-total-tokens must hold one prompt plus its output")
    if args.interleave == "auto":
        args.interleave = "on" if args.device == "cpu" else "off"
    args.interleave = args.interleave == "on"
    if args.linker_config:
        try:
            extra = json.loads(args.linker_config)
        except ValueError as exc:
            p.error(f"--linker-config: not JSON ({exc})")
        if not isinstance(extra, dict):
            p.error("--linker-config: must be a JSON object")
        args.linker_config = extra
    else:
        args.linker_config = {}
    return args


def main(argv: list[str] | None = None) -> int:
    return Bench(parse_args(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
