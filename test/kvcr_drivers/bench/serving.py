"""What the serving drivers share: their common server options, the server
command line they launch, streaming TTFT, pausing servers that take turns, and
reading ``KVCR_STATS`` lines and start-up errors from a server's log."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import statistics
import time
from collections.abc import Iterator
from typing import Any

import requests

from cpu_harness import server as harness
from kvcr_drivers import cli
from kvcr_drivers.bench import decode_itl
from sglang.srt.mem_cache.storage.kvcr.config.startup_checks import TREE_CORE_ENV

STATS_RE = re.compile(r"KVCR_STATS .*")
STATS_FIELD_RE = re.compile(r"(\w+)=(-?[0-9.]+)\b")
ERROR_RE = re.compile(r"^\s*(?:[A-Za-z_][\w.]*)?(?:Error|Exception)\b[^:]*: .*$")
FRAME_RE = re.compile(r'^\s*File "(.+)", line (\d+), in (\S+)')
GIB = 1 << 30
MIB = 1 << 20


def add_server_options(
    p: argparse.ArgumentParser, *, prompt_len: int, output_len: int
) -> None:
    """The model, device, page, prompt and pool options of every serving driver,
    with the linker's operation timeout and extra server flags."""
    p.add_argument("--model-path", default="", help="default: the tiny CPU model")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=prompt_len)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=0,
        help="device KV pool size (default: 4x prompt len)",
    )
    p.add_argument(
        "--filler-requests",
        type=int,
        default=0,
        help="fillers per replay (default: enough to cycle the device pool twice)",
    )
    p.add_argument("--operation-timeout-ms", type=int, default=10000)
    p.add_argument(
        "--server-args",
        default="",
        help="extra launch_server flags for every server, e.g. "
        "'--attention-backend fa3' on GPU",
    )


def check_server_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.page_size < 1 or args.prompt_len < 2 * args.page_size:
        p.error("--prompt-len must cover at least two pages of --page-size")
    if args.output_len < 1:
        p.error("--output-len must be >= 1")
    if args.operation_timeout_ms < 1:
        p.error("--operation-timeout-ms must be >= 1")


class ServingRun:
    """What a serving driver sets up from its options: the model, its prompts'
    vocabulary and generator, the device pool size and the report directory."""

    def __init__(self, args: argparse.Namespace, work_name: str) -> None:
        from cpu_harness.tiny_model import ensure_tiny_model

        self.args = args
        self.rng = random.Random(args.seed)
        self.model = args.model_path or str(ensure_tiny_model())
        self.vocab = 300 if not args.model_path else 30000
        self.max_total = args.max_total_tokens or 4 * args.prompt_len
        self.work = cli.work_dir(args, work_name)

    def prompt(self) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(self.args.prompt_len)]


def page_aligned(prompt_len: int, page: int) -> int:
    """Tokens of a prompt a prefix cache can serve (SGLang keeps one to compute)."""
    return (prompt_len - 1) // page * page


def stream_ttft(
    server: harness.ServerHandle,
    ids: list[int],
    max_new_tokens: int,
    timeout: float,
) -> dict[str, Any]:
    """One streaming /generate: TTFT = send -> first ``data:`` chunk (ms)."""
    payload = decode_itl.stream_payload(ids, max_new_tokens)
    started = time.perf_counter()
    first: float | None = None
    last: dict[str, Any] = {}
    with requests.post(
        server.base_url + "/generate", json=payload, stream=True, timeout=timeout
    ) as resp:
        if resp.status_code != 200:
            raise RuntimeError(
                f"/generate returned {resp.status_code}: {resp.text[:2000]}\n"
                f"--- server log tail ---\n{server.log_tail()}"
            )
        for line in resp.iter_lines(chunk_size=None):  # each chunk as it arrives
            if not line.startswith(b"data:"):
                continue
            body = line[5:].strip()
            if body == b"[DONE]":
                break
            if first is None:
                first = time.perf_counter()
            last = json.loads(body)
    done = time.perf_counter()
    if first is None:
        raise RuntimeError("streaming /generate returned no chunk")
    meta = last.get("meta_info", {}) or {}
    details = meta.get("cached_tokens_details") or {}
    sample = {
        "ttft_ms": round((first - started) * 1000.0, 3),
        "e2e_ms": round((done - started) * 1000.0, 3),
        "cached_tokens": int(meta.get("cached_tokens", 0) or 0),
        "device_cached_tokens": int(details.get("device", 0) or 0),
        "external_cached_tokens": int(details.get("host", 0) or 0),
        "output_tokens": len(last.get("output_ids") or []),
    }
    stages = request_stages(meta)  # only with --enable-metrics (--stage-split)
    if stages is not None:
        sample["stages_ms"] = stages
    return sample


# SGLang's own timestamps of one request (``--enable-metrics``; seconds, each
# process's clock put on the wall clock), in the order a request passes them.
STAGE_MARKS = (
    "request_received_ts",  # the HTTP server has the request
    "api_server_dispatch_finish_ts",  # tokenized and sent to the scheduler
    "forward_entry_time",  # in a batch about to run (scheduler)
    "prefill_finished_time",  # its prefill's result is being processed
    "request_finished_ts",  # its output is back in the HTTP server
)
STAGES = ("tokenizer", "before_forward", "forward", "after_forward")


def request_stages(meta: dict[str, Any]) -> dict[str, float] | None:
    """Milliseconds between consecutive ``STAGE_MARKS`` (``STAGES``), or None when
    the server did not report every mark (no ``--enable-metrics``)."""
    marks = [meta.get(k) for k in STAGE_MARKS]
    if not all(isinstance(m, (int, float)) and m > 0 for m in marks):
        return None
    return {
        name: round((end - start) * 1000.0, 4)
        for name, start, end in zip(STAGES, marks[:-1], marks[1:], strict=True)
    }


def pause(server: harness.ServerHandle) -> None:
    """SIGSTOP every process of the server's group (it holds no client request)."""
    if server.alive():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pgid, signal.SIGSTOP)


def resume(server: harness.ServerHandle) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pgid, signal.SIGCONT)


SETTLE_S = 0.1  # deferred work after a response (a write-through) ends within it
# The wait after a resume also varies by up to this much, from a fixed seed: a
# server's periodic idle work (a progress loop's 100 ms wake, say) then lands at
# a random point of the measured request, as between real requests. A fixed
# wait puts every timer that fired on the resume one period later at the same
# point of every request: with a 100 ms period and a 100 ms wait, at its start.
PHASE_SPREAD_S = 0.2
_PHASES = random.Random(0x5E771E)


@contextlib.contextmanager
def running(
    server: harness.ServerHandle, settle_s: float = SETTLE_S
) -> Iterator[float]:
    """Resume a paused server for one measurement, letting deferred work settle
    (``settle_s``, plus up to ``PHASE_SPREAD_S`` before the measurement, the
    extra wait given to the ``with`` block: a rate timed around it leaves it out)."""
    resume(server)
    spread = _PHASES.uniform(0.0, PHASE_SPREAD_S)
    time.sleep(settle_s + spread)
    try:
        yield spread
    finally:
        time.sleep(settle_s)  # e.g. the write-through offload after a response
        pause(server)


def summarize(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {
        "n": len(values),
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def startup_error(log_text: str) -> str:
    """The exception line that stopped a server, with where it was raised (the
    innermost frame, and the innermost SGLang frame when that differs)."""
    lines = log_text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if not ERROR_RE.match(lines[i]) or "Ignore import error" in lines[i]:
            continue
        frames = []
        for j in range(i - 1, max(-1, i - 80), -1):
            m = FRAME_RE.match(lines[j])
            if m:
                path = m.group(1)
                cut = path.find("site-packages/")
                path = path[cut + len("site-packages/") :] if cut >= 0 else path
                frames.append(f"{path}:{m.group(2)} in {m.group(3)}")
            elif lines[j].startswith("Traceback"):
                break
        where = frames[:1] + [f for f in frames if f.startswith("sglang/")][:1]
        where = list(dict.fromkeys(where))
        return lines[i].strip() + (
            f" (raised at {'; from '.join(where)})" if where else ""
        )
    return "server did not start (no exception line in its log)"


def parse_stats(line: str) -> dict[str, float]:
    """The numeric ``name=value`` fields of one KVCR_STATS line."""
    return {k: float(v) for k, v in STATS_FIELD_RE.findall(line)}


def kvcr_linker_config(
    dram_bytes: int, operation_timeout_ms: int, extra: dict[str, Any]
) -> dict[str, Any]:
    """The benchmark's KVCR linker config (CPU-safe timeouts, room for big pages)."""
    return {
        "local_dram_bytes_per_worker": dram_bytes,
        # KVCR stops serving peers after a progress stall longer than the
        # operation timeout; CPU prefill on two cores stalls it for seconds.
        "operation_timeout_ms": operation_timeout_ms,
        "abandon_timeout_ms": 2 * operation_timeout_ms,
        "preparation_timeout_ms": 5000,
        # One write-through offload carries a whole prompt: 3000 tokens of a
        # Qwen3-0.6B-like model are 329 MiB, over the 256 MiB default, which would
        # refuse every such offload. Keep the bound, but above one prompt.
        "max_inflight_offload_bytes": 2 * GIB,
        "max_inflight_prepare_bytes": 2 * GIB,
        **extra,
    }


def prefill_chunk(tokens: int, page: int) -> int:
    """``--chunked-prefill-size`` for prompts of ``tokens``: one chunk per prompt
    (at least 512), a whole number of pages (SGLang refuses any other size)."""
    want = max(tokens, 512)
    return -(-want // page) * page


def base_server_args(args: argparse.Namespace, max_total: int) -> list[str]:
    extra = [
        "--page-size",
        str(args.page_size),
        "--max-total-tokens",
        str(max_total),
        "--max-running-requests",
        "4",
        "--chunked-prefill-size",
        str(prefill_chunk(args.prompt_len, args.page_size)),
    ]
    if args.device == "cuda":
        extra = ["--device", "cuda", *extra]
    return extra + args.server_args.split()


def server_env(device: str) -> dict[str, str] | None:
    """On CUDA every arm runs SGLang's Python radix tree core, the one the linker
    selects: on the first H200 run the no-linker arm's Rust tree core stopped the
    scheduler at its first checkpoint insert ("insert value must be an int64
    tensor, got Uint8"), so the arms compare the linker alone."""
    if device != "cuda":
        return None
    return {"SGLANG_USE_CPU_ENGINE": "false", TREE_CORE_ENV: "python"}
