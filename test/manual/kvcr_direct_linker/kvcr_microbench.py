"""CPU benchmark of the KVCR direct linker against plain baselines (``make bench``).

Measures, in one run and side by side:

(e) ``zero_hit_ttft_ratio``: median streaming TTFT of unique prompts on the CPU
    SGLang server with the KVCR linker over the same prompts without it. Runs
    first, before any KVCR lives in this process. The servers are up together
    and run one at a time (the others SIGSTOPped), in rotating order, so load
    from elsewhere hits every variant alike; a third server with SGLang's Python
    radix tree core (which the plugin selects) splits that cost from the linker's.
    With ``--stage-split`` (off by default: it turns SGLang's and kvcr's metrics
    on) also ``zero_hit_ttft_ratio_outside_forward``, what kvcr adds outside the
    forward window by SGLang's request timestamps (``bench/zero_hit_stages.py``).
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
    through, over the same load on the ``none`` server
    (``kvcr_drivers/bench/decode_itl.py`` says what a sample is). The KVCR_STATS
    delta over the rounds proves the write-through happened; a phase that offloaded
    nothing is an error, not a number.
(g) ``replay_ttft_vs_device_hit`` / ``replay_ttft_vs_recompute`` (serving section,
    between the decode ITL and the TTFT rounds): each of ``--replay-rounds`` rounds (after one
    warm-up) sends a fresh seed prompt P to the kvcr and none servers in turn: cold,
    again after a 0.1 s pause (a device radix-cache hit), then unique fillers that
    cycle the device pool twice, then, after the same pause, P again (the pauses
    keep the write-through of the request before out of each sample). On kvcr that replay is served from KVCR (the
    linker wrote P through before the fillers evicted it from the device), on none
    it is recomputed; the cached tokens each server reports must say so, or both
    metrics fail with the reason. Median kvcr replay TTFT over the median kvcr
    device-hit TTFT (target 1.05), and over the median none replay
    (informational). ``kvcr_drivers/bench/serving_replay.py`` says more.
(h) ``write_through_pages_per_s`` (informational) / ``write_through_refusals``
    (target 0): pages the kvcr server offloaded per second of its running time in
    the replay rounds (their seeds and fillers are back-to-back unique prefills),
    and its offloads refused or failed (``offload_failures`` + ``refused_offload``
    + ``staging_full``), from the KVCR_STATS deltas over those rounds.
    ``write_through_back_to_back`` (informational): in the same rounds, how much
    more the kvcr server's fillers (each served while the write-through of the one
    before is still being done) slow down against its cold P (after a pause) than
    none's do.
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
passed), with a PNG of every sample beside it (``kvcr_drivers/bench/plot.py``;
matplotlib, the ``plot`` extra). Exits non-zero when any metric misses its target;
informational metrics have no target. The sections live in
``test/kvcr_drivers/bench``; the figures of the last recorded run are in
docs/kvcr_direct_linker.md ("Benchmark figures").
"""

from __future__ import annotations

import argparse
import sys
import time

import _paths  # noqa: F401  (the repository's test/ on sys.path)

from kvcr_drivers import cli
from kvcr_drivers.bench.micro import (
    DEFAULT_SKIP,
    DEFAULT_TRANSFER,
    SECTION_NAMES,
    report,
    run_sections,
)


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
    # 24 rounds: the p99 is then about the 23rd largest of ~2300 gaps; at 8
    # rounds (8th of 760) it moved 0.92x-1.34x between runs of one commit.
    cli.add_itl_options(p, rounds=24, rounds_help="decode_itl rounds")
    p.add_argument(
        "--itl-stats-wait-s",
        type=float,
        default=40.0,
        help="after the decode_itl rounds, wait up to this long for a KVCR_STATS "
        "line (logged every 30 s) to count what was offloaded",
    )
    p.add_argument(
        "--replay-rounds",
        type=int,
        default=60,
        help="evict-and-replay rounds after one warm-up (each cycles the device "
        "pool of kvcr and none twice; at 25 the ratio's bootstrap sd was 4-7%%)",
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
    p.add_argument(
        "--previous-path-too",
        action="store_true",
        help="cuda: also run each transfer size on the previous device path (one "
        "stream, a torch call per part: informational previous_path_* figures)",
    )
    p.add_argument(
        "--ttft-prompts",
        type=int,
        default=120,
        help="zero-hit TTFT rounds, one unique prompt per server each (at 40, "
        "back-to-back runs' medians differed by up to 8%%)",
    )
    p.add_argument(
        "--stage-split",
        action="store_true",
        help="serving: start every server with SGLang's --enable-metrics and split "
        "each zero-hit TTFT by its request timestamps (the informational "
        "zero_hit_ttft_ratio_outside_forward); changes what the serving section "
        "measures (SGLang's metrics in every arm, kvcr's own exporter in its arm)",
    )
    p.add_argument("--ttft-prompt-len", type=int, default=1024)
    p.add_argument("--ttft-page-size", type=int, default=16)
    p.add_argument("--ttft-warmup", type=int, default=5)
    cli.add_run_options(p)
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
    args = p.parse_args(argv)
    if args.quick:
        apply_quick(args, p)
    if args.skip is None:
        args.skip = DEFAULT_SKIP[args.device]
    args.skip = set(cli.comma_list(p, "--skip", args.skip, SECTION_NAMES))
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
    cli.check_itl_options(p, args)
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
    if args.replay_rounds < 1:
        p.error("--replay-rounds must be >= 1")
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
    "replay_rounds": 2,
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    work = cli.work_dir(args, "bench")
    metrics, details, load = run_sections(args, work)
    return report(args, work, metrics, details, load, time.monotonic() - started)


if __name__ == "__main__":
    sys.exit(main())
