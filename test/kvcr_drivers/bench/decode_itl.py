"""Foreground decode inter-token latency under write-through load (benchmark support).

One streaming ``/generate`` request decodes many tokens while unique background
prompts reach the same server, one when the decode starts and one after every
``every_tokens`` of its output tokens (from up to ``concurrency`` threads); every
such prompt's prefill inserts new pages, which a KVCR linker writes through to its
DRAM.

A sample is one output token after the first: the time between the chunk that
carried it and the chunk before, divided evenly over the tokens that chunk carried
(``meta_info.completion_tokens`` is the running output count, so a chunk holding
several tokens contributes that many equal gaps and no token is dropped or
double-counted; a chunk with no new token is skipped). Times are taken where the
client receives each chunk (``iter_lines(chunk_size=None)``, so no chunk waits in
a read buffer for the next), which is what a streaming user sees. The raw chunk
gaps are kept as well.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import requests

from kvcr_drivers.bench.metrics import dist

STATS_STAMP_RE = re.compile(
    r"^\[?(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)[^\]]*\]?.*?(KVCR_STATS .*)$", re.M
)


def stream_payload(ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    """A greedy streaming ``/generate`` body that decodes exactly
    ``max_new_tokens`` tokens."""
    return {
        "input_ids": [int(t) for t in ids],
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        },
        "stream": True,
    }


def stream_tokens(
    base_url: str,
    ids: list[int],
    max_new_tokens: int,
    timeout: float,
    on_tokens: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """One streaming /generate; arrival time (ms after send) and running output
    token count of every ``data:`` chunk (``on_tokens`` is told each count)."""
    payload = stream_payload(ids, max_new_tokens)
    chunks: list[tuple[float, int]] = []
    last: dict[str, Any] = {}
    seen_ids = 0
    started = time.perf_counter()
    with requests.post(
        base_url + "/generate", json=payload, stream=True, timeout=timeout
    ) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"/generate returned {resp.status_code}: {resp.text}")
        # chunk_size=None: hand over each chunk as it arrives (the default 512
        # bytes would hold a chunk back until the next one fills the buffer).
        for line in resp.iter_lines(chunk_size=None):
            if not line.startswith(b"data:"):
                continue
            body = line[5:].strip()
            if body == b"[DONE]":
                break
            at = (time.perf_counter() - started) * 1000.0
            last = json.loads(body)
            meta = last.get("meta_info") or {}
            seen_ids += len(last.get("output_ids") or [])
            tokens = int(meta.get("completion_tokens") or seen_ids)
            chunks.append((round(at, 3), tokens))
            if on_tokens is not None:
                on_tokens(tokens)
    if not chunks:
        raise RuntimeError("streaming /generate returned no chunk")
    meta = last.get("meta_info") or {}
    cached = meta.get("cached_tokens_details") or {}
    return {
        "ttft_ms": chunks[0][0],
        "e2e_ms": round((time.perf_counter() - started) * 1000.0, 3),
        "chunks": chunks,
        "output_tokens": chunks[-1][1],
        "cached_tokens": int(meta.get("cached_tokens", 0) or 0),
        "device_cached_tokens": int(cached.get("device", 0) or 0),
        "external_cached_tokens": int(cached.get("host", 0) or 0),
    }


def token_gaps(chunks: list[tuple[float, int]]) -> list[float]:
    """Per-token inter-token latency (ms) from (arrival ms, running tokens) chunks."""
    gaps: list[float] = []
    t0, n0 = chunks[0]
    for t1, n1 in chunks[1:]:
        carried = n1 - n0
        if carried > 0:  # a chunk with no new token does not reset the clock
            gaps += [round((t1 - t0) / carried, 4)] * carried
            t0, n0 = t1, n1
    return gaps


def chunk_gaps(chunks: list[tuple[float, int]]) -> list[float]:
    return [round(b[0] - a[0], 4) for a, b in itertools.pairwise(chunks)]


@dataclass
class BackgroundLoad:
    """Background prompts (unique, non-streaming, one output token), one per
    ``trigger()``, from up to ``concurrency`` threads. The foreground decode
    triggers one every few of its tokens, so the prefills (and the write-through
    they cause) land inside its window at any machine speed; a closed loop would
    always have a prefill waiting, and SGLang runs waiting prefills before decode
    steps, starving the decode. ``make_prompt`` is called under a lock, so a seeded
    generator yields the same sequence to every server it is used on."""

    base_url: str
    make_prompt: Callable[[], list[int]]
    concurrency: int
    timeout: float = 300.0
    records: list[dict[str, float | int | str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pending = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        self.triggered = 0

    def start(self) -> None:
        for i in range(self.concurrency):
            t = threading.Thread(target=self._worker, name=f"itl-load-{i}", daemon=True)
            self._threads.append(t)
            t.start()

    def trigger(self) -> None:
        self.triggered += 1
        self._pending.release()

    def _worker(self) -> None:
        while not self._stop.is_set():
            if not self._pending.acquire(timeout=0.05):
                continue
            with self._lock:
                ids = self.make_prompt()
            record = self._send(ids)
            with self._lock:
                self.records.append(record)

    def _send(self, ids: list[int]) -> dict[str, float | int | str]:
        payload = {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": 1,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        }
        sent = time.time()
        try:
            resp = requests.post(
                self.base_url + "/generate", json=payload, timeout=self.timeout
            )
            ok = resp.status_code == 200
            meta = resp.json().get("meta_info", {}) if ok else {}
            status = "ok" if ok else f"http {resp.status_code}"
        except (requests.RequestException, ValueError) as exc:
            meta, status = {}, type(exc).__name__
        return {
            "sent": sent,
            "done": time.time(),
            "status": status,
            "cached_tokens": int(meta.get("cached_tokens", 0) or 0),
        }

    def stop(self, timeout: float) -> list[dict[str, float | int | str]]:
        """Let the in-flight requests finish (bounded), then return every record;
        triggers no thread took up by then are dropped."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = sum(t.is_alive() for t in self._threads)
        if alive:
            raise TimeoutError(f"{alive} background load threads still running")
        with self._lock:
            return list(self.records)


def itl_round(
    base_url: str,
    fg_ids: list[int],
    make_prompt: Callable[[], list[int]],
    *,
    concurrency: int,
    every_tokens: int,
    output_len: int,
    timeout: float,
) -> dict[str, Any]:
    """One foreground streaming decode; a background prompt is sent when it
    starts and after every ``every_tokens`` of its output tokens."""
    load = BackgroundLoad(base_url, make_prompt, concurrency, timeout)
    marks = iter(range(every_tokens, output_len, every_tokens))
    next_mark = [next(marks, None)]

    def on_tokens(tokens: int) -> None:
        while next_mark[0] is not None and tokens >= next_mark[0]:
            load.trigger()
            next_mark[0] = next(marks, None)

    load.start()
    try:
        load.trigger()
        window_start = time.time()
        fg = stream_tokens(base_url, fg_ids, output_len, timeout, on_tokens)
        window_end = time.time()
    finally:
        records = load.stop(timeout)
    in_window = [
        r
        for r in records
        if window_start <= float(r["done"]) <= window_end and r["status"] == "ok"
    ]
    return {
        **fg,
        "itl_ms": token_gaps(fg["chunks"]),
        "chunk_gap_ms": chunk_gaps(fg["chunks"]),
        "window": [round(window_start, 3), round(window_end, 3)],
        "background_triggered": load.triggered,
        "background_sent": len(records),
        "background_failed": sum(r["status"] != "ok" for r in records),
        "background_done_in_window": len(in_window),
        "background_cached_tokens": sum(int(r["cached_tokens"]) for r in records),
    }


def prompt_maker(seed: int, length: int, vocab: int) -> Callable[[], list[int]]:
    rng = random.Random(seed)
    return lambda: [rng.randrange(3, vocab) for _ in range(length)]


def itl_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Pooled per-token ITL over every round (p50/p99 in ms)."""
    gaps = [g for r in rounds for g in r["itl_ms"]]
    if not gaps:
        return {"n": 0, "p50": None, "p99": None}
    return {
        **dist(gaps, digits=4),
        "rounds": len(rounds),
        "background_done_in_window": sum(
            r["background_done_in_window"] for r in rounds
        ),
        "background_failed": sum(r["background_failed"] for r in rounds),
    }


def stamped_stats(log_text: str) -> list[tuple[str, str]]:
    """(log timestamp, KVCR_STATS line) for every stats line with a timestamp."""
    return [(m.group(1), m.group(2)) for m in STATS_STAMP_RE.finditer(log_text)]
