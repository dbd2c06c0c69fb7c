"""Fault injection, soak, hostile-input fuzzing and TP=2 for the KVCR direct linker.

``make faults`` runs this driver. Everything runs on the real kvcr 0.1.1 + NIXL over
CPU tensors on loopback; nothing is mocked except one injected device-copy fault.

1. Scenarios (``run_fast_scenarios``; all of them also run in ``make test``
   through ``test_kvcr_faults.py``). In-process linkers over real CPU pools, and
   peer linkers in spawned child processes: a peer frozen with SIGSTOP (shorter and
   longer than the operation timeout) then resumed with SIGCONT, killed with
   SIGKILL while fetches are in flight, and restarted on the same control
   endpoint; a flush of the worker that still holds the dead peer's quarantined
   operation; a stale hint; a preparation deadline with late completions; a
   restore copy that fails on one layer (real cache + wrapper: SGLang aborts the
   request with its reason); a flush during in-flight offload and preparation
   (direct and staged offload paths); KVCR capacity exhausted; offload
   backpressure; a hint outside the allowlist (listening sockets must see no
   connection); and a peer that never answers (the documented dead-peer case: KVCR
   keeps the quarantined operation and ``close()`` retains its resources; run in a
   child process). Each scenario checks that no wrong KV was admitted (bytes
   compared, lookups report only claimed pages), that claims were released (in the
   linker and in KVCR), that no thread outlived ``close()``, and that RSS stayed
   bounded.
2. Soak: two CPU SGLang servers with the KVCR linker (A and B), ``--soak-requests``
   requests over mixed shared prefixes with device and KVCR evictions, some of B's
   (and A's) requests carrying a ``kv.fetch`` hint naming the other. Greedy outputs
   of repeated prompts must agree; scheduler RSS at the start (after warm-up) and
   end, and each linker's final claims and abandoned/quarantined bytes (from its
   last ``KVCR_STATS`` line, logged at shutdown) are recorded.
3. Fuzz: ``test_kvcr_fuzz.py`` under pytest with ``KVCR_FUZZ_EXAMPLES`` examples.
4. TP=2: one CPU server with ``--tp 2`` (two scheduler ranks over gloo, each with
   its own KVCR): compute, evict from the device, replay restored from KVCR on both
   ranks, flush; outputs equal the server's own uncached run.

Writes a JSON report (top-level ``scenarios``, ``soak``, ``fuzz``); the last line
printed is ``REPORT <path>``. Exits non-zero when anything failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[3]
for _path in (REPO / "test", REPO / "test" / "cpu_harness" / "pythonpath"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch  # noqa: E402

PAGE = 4
LAYERS = 2
HEADS = 2
DIM = 8
POOL_TOKENS = 64 * PAGE
PAGE_BYTES = LAYERS * 2 * PAGE * HEADS * DIM * 2  # one page, K and V, bf16
WAIT_S = 15.0
CHILD_START_S = 120.0
RSS_BOUND_MB = 96.0  # per scenario, after close
# A stale hint must fail well before a (long) operation timeout: it is declined.
STALE_TIMEOUT_MS = 10_000
DEADLINE_MS = 1500  # preparation deadline of the late-completion scenario
THREAD_SETTLE_S = 5.0
BASE_CONFIG: dict[str, Any] = {
    "local_dram_bytes_per_worker": 64 * PAGE_BYTES,
    # Room for a loaded 2-core machine: a 0.4 s freeze must stay well inside it.
    "operation_timeout_ms": 2000,
    "abandon_timeout_ms": 4000,
    "preparation_timeout_ms": 5000,
    "owner_wait_timeout_s": 20.0,
}
# A peer (source) must not time out while it is frozen: KVCR stops serving peers
# after a progress stall longer than its own operation timeout.
PEER_CONFIG: dict[str, Any] = {
    **BASE_CONFIG,
    "operation_timeout_ms": 20000,
    "abandon_timeout_ms": 40000,
}


# ---- small helpers ---------------------------------------------------------------


def rss_mb(pid: int | None = None) -> float:
    """Resident set size of ``pid`` (default: this process) in MiB."""
    path = f"/proc/{pid or 'self'}/status"
    for line in Path(path).read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return 0.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_until(
    predicate: Callable[[], bool], timeout: float = WAIT_S, what: str = "condition"
) -> float:
    """Poll ``predicate`` until true; returns seconds waited, raises at the deadline."""
    started = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what}: not reached within {timeout} s")
        time.sleep(0.002)


def page_hashes(n: int, salt: str) -> list[str]:
    return [hashlib.sha256(f"{salt}/{i}".encode()).hexdigest() for i in range(n)]


def kv_transfer(hashes: list[str], pages: list[int] | None = None) -> list[Any]:
    from sglang.srt.mem_cache.hicache_storage import (
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )

    indices = None
    if pages is not None:
        indices = torch.tensor(
            [p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64
        )
    return [
        PoolTransfer(
            name=PoolName.KV,
            keys=list(hashes),
            device_indices=indices,
            hit_policy=PoolHitPolicy.ALL_PAGES,
        )
    ]


def kv_buffers(pool: Any) -> list[torch.Tensor]:
    return [
        b
        for layer in range(LAYERS)
        for b in (pool.k_buffer[layer], pool.v_buffer[layer])
    ]


def fill_pages(pool: Any, pages: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for buf in kv_buffers(pool):
        for p in pages:
            buf[p * PAGE : (p + 1) * PAGE] = torch.randn(
                PAGE, HEADS, DIM, generator=gen
            ).to(buf.dtype)


def page_bytes(pool: Any, page: int, layers: range | None = None) -> bytes:
    rows = [
        buf[page * PAGE : (page + 1) * PAGE].reshape(-1).view(torch.uint8)
        for layer in (layers if layers is not None else range(LAYERS))
        for buf in (pool.k_buffer[layer], pool.v_buffer[layer])
    ]
    return bytes(torch.cat(rows).numpy().tobytes())


def make_pool() -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        POOL_TOKENS,
        PAGE,
        torch.bfloat16,
        HEADS,
        DIM,
        LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )


def make_linker(pool: Any, **overrides: Any) -> Any:
    from cpu_harness import kvcr_stack

    return kvcr_stack.bare_linker(
        pool, PAGE, {**BASE_CONFIG, **overrides}, model="kvcr-faults"
    )


def fetch_hint(endpoint: str, hashes: list[str]) -> dict[str, Any]:
    from sglang.srt.mem_cache.storage.kvcr.router_hint import page_hash_to_u64

    return {
        "protocol_version": "1.0",
        "message_id": f"faults-{time.monotonic_ns()}",
        "actions": [
            {
                "action_id": "fetch-0",
                "action_type": "kv.fetch",
                "action_version": "1.0",
                "payload": {
                    "source_control_endpoint": endpoint,
                    "block_hashes": [page_hash_to_u64(h) for h in hashes],
                },
            }
        ],
    }


def ctx(rid: str, hint: Any = None, attempt: int = 0) -> Any:
    from sglang.srt.mem_cache.storage.kvcr.linker_hooks import LinkerRequestContext

    return LinkerRequestContext(rid, attempt, hint)


def offload_and_commit(linker: Any, hashes: list[str], pages: list[int]) -> bool:
    assert linker.offload(kv_transfer(hashes, pages)) is True
    wait_until(lambda: linker.num_completed_offloads() >= 1, what="offload completion")
    return bool(linker.pop_completed_offload())


def prepare(linker: Any, rid: str, hashes: list[str], hint: Any = None) -> float:
    """prepare_request then poll preparation_ready; returns the seconds it took."""
    started = time.monotonic()
    handle = linker.prepare_request(ctx(rid, hint), kv_transfer(hashes))
    wait_until(lambda: linker.preparation_ready(handle), what=f"{rid} prepared")
    return time.monotonic() - started


def restore(linker: Any, rid: str, hashes: list[str], pages: list[int]) -> bool:
    assert linker.load(rid, kv_transfer(hashes, pages)) is True
    index = linker.start_layer_wise_loading()
    assert index >= 0
    return bool(linker.finish_layer_wise_loading(index))


def local_round_trip(
    linker: Any, pool: Any, tag: str, src: int, dst: int, *, seed: int
) -> tuple[bool, bool]:
    """Fill page ``src``, offload it, restore it into ``dst``: (stored, exact)."""
    fill_pages(pool, [src], seed=seed)
    hashes = page_hashes(1, tag)
    stored = offload_and_commit(linker, hashes, [src])
    prepare(linker, tag, hashes)
    exact = restore(linker, tag, hashes, [dst]) and page_bytes(pool, dst) == page_bytes(
        pool, src
    )
    linker.finish_request(tag)
    return stored, exact


def kvcr_claims(linker: Any) -> int:
    """Release handles KVCR itself still counts as held (kvcr 0.1.1 internals)."""
    return int(
        linker._adapter.call(lambda kv: len(kv._core._local_dram._public_claims))
    )


def settle(linker: Any) -> tuple[int, int]:
    """Let in-flight KVCR work finish and late claims be released; returns
    (claims the linker holds, claims KVCR holds)."""
    linker._adapter.wait_idle(WAIT_S)
    linker._pump()  # may submit releases of late claims; call() runs after them
    linker._adapter.wait_idle(WAIT_S)
    linker._pump()
    return linker.claims_held(), kvcr_claims(linker)


@contextlib.contextmanager
def owner_stalled(linker: Any, hold_s: float = WAIT_S) -> Iterator[threading.Event]:
    """Keep the linker's KVCR owner thread busy; set the yielded event to let go."""
    entered, gate = threading.Event(), threading.Event()

    def hold(_kv: Any) -> None:
        entered.set()
        gate.wait(hold_s)

    caller = threading.Thread(
        target=linker._adapter.call, args=(hold, hold_s + 5), name="fault-stall"
    )
    caller.start()
    if not entered.wait(WAIT_S):
        raise AssertionError("the owner thread never picked up the stall")
    try:
        yield gate
    finally:
        gate.set()
        caller.join(WAIT_S)


class LogCapture(logging.Handler):
    """Collects formatted records of the kvcr adapter logger (resilience, close)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.lines.append(record.getMessage())

    def count(self, needle: str) -> int:
        return sum(needle in line for line in self.lines)

    @contextlib.contextmanager
    def attached(self) -> Iterator[LogCapture]:
        target = logging.getLogger("sglang.srt.mem_cache.storage.kvcr")
        target.addHandler(self)
        try:
            yield self
        finally:
            target.removeHandler(self)


def retained_count() -> int:
    from sglang.srt.mem_cache.storage.kvcr import kvcr_adapter

    return len(kvcr_adapter._RETAINED)


# ---- scenario records ----------------------------------------------------------


@dataclasses.dataclass
class Scenario:
    """One scenario's verdict: named checks plus what happened."""

    name: str
    checks: dict[str, bool] = dataclasses.field(default_factory=dict)
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    outcome: str = ""
    output_matches_control: bool = False
    claims_leaked: int = 0
    error: str = ""
    wall_s: float = 0.0
    blocked: bool = False

    def check(self, label: str, ok: Any) -> bool:
        self.checks[label] = bool(ok)
        return bool(ok)

    @property
    def passed(self) -> bool:
        return not self.error and bool(self.checks) and all(self.checks.values())

    def failed_checks(self) -> list[str]:
        return [k for k, ok in self.checks.items() if not ok]

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "passed": self.passed,
            "outcome": self.outcome,
            "output_matches_control": self.output_matches_control,
            "claims_leaked": self.claims_leaked,
            "blocked": self.blocked,
            "checks": self.checks,
            "failed_checks": self.failed_checks(),
            "error": self.error,
            "wall_s": round(self.wall_s, 3),
            "details": self.details,
        }

    def summary(self) -> str:
        failed = self.failed_checks()
        return (
            f"{self.name}: {'PASS' if self.passed else 'FAIL'} ({self.wall_s:.1f} s) "
            f"{self.outcome}"
            + (f" | failed: {failed}" if failed else "")
            + (f" | error: {self.error.splitlines()[-1]}" if self.error else "")
        )


class Harness:
    """Builds a scenario's linkers and, at the end, checks what they leave behind.

    ``finish`` settles every linker, counts claims still held by the linker and by
    KVCR (``claims_leaked``), closes the linkers, and checks that the threads
    started since the scenario began have exited and RSS grew by at most
    ``RSS_BOUND_MB``.
    """

    def __init__(self, scenario: Scenario) -> None:
        self.sc = scenario
        self.linkers: list[Any] = []
        self.pools: list[Any] = []
        self.threads0 = set(threading.enumerate())
        self.rss0 = rss_mb()
        self.retained0 = retained_count()
        self._closed: set[int] = set()

    def linker(self, **overrides: Any) -> tuple[Any, Any]:
        pool = make_pool()
        lk = make_linker(pool, **overrides)
        self.pools.append(pool)
        self.linkers.append(lk)
        return pool, lk

    def claims(self) -> int:
        total = 0
        for lk in self.linkers:
            if id(lk) in self._closed:
                continue
            linker_held, kvcr_held = settle(lk)
            total += linker_held + kvcr_held
        return total

    def close(self, lk: Any) -> None:
        if id(lk) not in self._closed:
            self._closed.add(id(lk))
            lk.close()

    def new_threads(self) -> list[str]:
        return sorted(
            t.name for t in set(threading.enumerate()) - self.threads0 if t.is_alive()
        )

    def finish(self, *, allow_retained: bool = False) -> None:
        leaked = self.claims()
        self.sc.claims_leaked = leaked
        self.sc.check("no claims held by the linkers or KVCR at the end", leaked == 0)
        for lk in self.linkers:
            self.close(lk)
        if not allow_retained:
            self.sc.check(
                "every KVCR closed cleanly (none retained)",
                retained_count() == self.retained0,
            )
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not self.new_threads(), THREAD_SETTLE_S, "threads")
        extra = self.new_threads()
        self.sc.details["threads_left"] = extra
        self.sc.check("no thread outlives close()", not extra)
        self.linkers.clear()
        self.pools.clear()
        grown = rss_mb() - self.rss0
        self.sc.details["rss_growth_mb"] = round(grown, 1)
        self.sc.check(f"RSS growth <= {RSS_BOUND_MB:.0f} MiB", grown <= RSS_BOUND_MB)


_WARM = False


def warm_up() -> None:
    """Build and close one linker, so one-time costs (imports, UCX and NIXL
    libraries) are not charged to the first scenario's RSS and thread checks."""
    global _WARM
    if not _WARM:
        make_linker(make_pool()).close()
        _WARM = True


def run_scenario(name: str, body: Callable[[Scenario], None]) -> Scenario:
    sc = Scenario(name)
    started = time.monotonic()
    try:
        warm_up()
        body(sc)
    except BaseException as exc:  # a scenario failure is a result, not a crash
        if isinstance(exc, KeyboardInterrupt):
            raise
        sc.error = traceback.format_exc()
    sc.wall_s = time.monotonic() - started
    return sc


# ---- 1a. in-process scenarios ----------------------------------------------------


def scenario_stale_hint(sc: Scenario) -> None:
    """B is told A holds pages A never had or has evicted: only A's resident pages
    are fetched, the hit stops at the first gap, nothing stale is restored."""
    h = Harness(sc)
    slow = {
        "operation_timeout_ms": STALE_TIMEOUT_MS,
        "abandon_timeout_ms": 2 * STALE_TIMEOUT_MS,
    }
    pool_a, a = h.linker(local_dram_bytes_per_worker=4 * PAGE_BYTES, **slow)
    pool_b, b = h.linker(**slow)
    old = page_hashes(2, "stale-old")
    new = page_hashes(4, "stale-new")
    fill_pages(pool_a, [1, 2, 3, 4, 5, 6], seed=11)
    sc.check("A stores the old pages", offload_and_commit(a, old, [1, 2]))
    sc.check("A stores four new pages", offload_and_commit(a, new, [3, 4, 5, 6]))
    evicted = set(a.take_removed_page_hashes())
    sc.check("capacity evicted exactly the old pages from A", evicted == set(old))
    a_bytes = {x: page_bytes(pool_a, p) for x, p in zip(new, [3, 4, 5, 6])}
    never = page_hashes(2, "stale-never")

    # [held, evicted, held]: the claimed prefix stops at the evicted page.
    tail = [new[0], old[0], new[1]]
    took = prepare(b, "mixed", tail, fetch_hint(a.endpoint, tail))
    sc.details["mixed_prepare_s"] = round(took, 3)
    sc.check(
        "a stale hint fails fast (within the operation timeout)",
        took < STALE_TIMEOUT_MS / 2000.0,
    )
    hit = b.lookup("mixed", kv_transfer(tail))
    sc.check("lookup reports only the claimed prefix [1]", hit == [1])
    sentinel = page_bytes(pool_b, 21)
    ok = restore(b, "mixed", tail[:1], [20])
    matches = ok and page_bytes(pool_b, 20) == a_bytes[new[0]]
    sc.check("the one restored page equals A's bytes", matches)
    sc.check("nothing else was written", page_bytes(pool_b, 21) == sentinel)
    b.finish_request("mixed")

    # Nothing the hint names exists on A.
    gone = [*old, *never]
    prepare(b, "gone", gone, fetch_hint(a.endpoint, gone))
    sc.check(
        "a wholly stale hint is a clean miss", b.lookup("gone", kv_transfer(gone)) == []
    )
    b.finish_request("gone")
    sc.details["hints"] = b._hints.stats.as_dict()
    sc.output_matches_control = matches
    sc.outcome = f"mixed hint hit {hit}; wholly stale hint missed; prepare {took:.3f} s"
    h.finish()


def scenario_preparation_deadline_late_completions(sc: Scenario) -> None:
    """Fetches that complete after the preparation deadline: released at once when
    the request already ended, held by the request (then released) otherwise."""
    h = Harness(sc)
    pool, lk = h.linker(preparation_timeout_ms=DEADLINE_MS)
    hashes = page_hashes(3, "deadline")
    fill_pages(pool, [1, 2, 3], seed=21)
    original = [page_bytes(pool, p) for p in (1, 2, 3)]
    sc.check("pages stored", offload_and_commit(lk, hashes, [1, 2, 3]))
    late_before = lk.stats.late_claims_released
    with owner_stalled(lk) as gate:
        ha = lk.prepare_request(ctx("early-end"), kv_transfer(hashes))
        hb = lk.prepare_request(ctx("late-land"), kv_transfer(hashes))
        sc.check("not ready before the deadline", not lk.preparation_ready(ha))
        waited = wait_until(lambda: lk.preparation_ready(ha), what="deadline")
        sc.check("ready once the deadline passed", waited >= DEADLINE_MS / 2000.0)
        wait_until(lambda: lk.preparation_ready(hb), what="second deadline")
        sc.check(
            "admitted at the deadline with nothing claimed: a miss",
            lk.lookup("early-end", kv_transfer(hashes)) == []
            and lk.lookup("late-land", kv_transfer(hashes)) == [],
        )
        lk.finish_request("early-end")  # this request ends before its fetch lands
        gate.set()
    sc.check("deadline counted", lk.stats.prepare_deadline_expired >= 2)
    settle(lk)
    late = lk.stats.late_claims_released - late_before
    sc.check("the ended request's late claims were released (3)", late == 3)
    sc.check("the live request holds its late-landed claims (3)", lk.claims_held() == 3)
    hit = lk.lookup("late-land", kv_transfer(hashes))
    ok = hit == [1, 2, 3] and restore(lk, "late-land", hashes, [30, 31, 32])
    matches = ok and [page_bytes(pool, p) for p in (30, 31, 32)] == original
    sc.check("late-landed claims restore the right bytes", matches)
    lk.finish_request("late-land")
    sc.check("abandoned bytes drained", lk.abandoned_bytes() == 0)
    sc.output_matches_control = matches
    sc.outcome = (
        f"deadline after {waited:.2f} s; {late} late claims released; "
        f"later lookup {hit}"
    )
    h.finish()


class InjectedCopyFault(Exception):
    """The fault injected into one layer's restore copy."""


class _FailingRows:
    """Stands in for one layer's restore destination rows: any use raises."""

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def __getattr__(self, name: str) -> Any:
        raise InjectedCopyFault(f"injected device copy fault on layer {self.layer}")


def scenario_failed_device_copy_mid_layer(sc: Scenario) -> None:
    """The restore copy raises on layer 1 (real UnifiedRadixCache + wrapper): the
    batch's load reports failure, SGLang aborts exactly that request with its
    reason, layer 1 is never written and nothing enters the tree, claims are
    released, and the linker stops restoring (later requests are clean misses)."""
    stack = build_stack()
    h = Harness(sc)
    h.linkers.append(stack.linker)
    cache, linker, kvcache = stack.cache, stack.linker, stack.kvcache
    prefix = list(range(100, 100 + 3 * PAGE))
    stack.insert_and_commit(prefix, seed=31)
    stack.evict(prefix)
    for buf in kv_buffers(kvcache):
        buf.zero_()
    pool = linker.layout.pools[0]
    # The CPU restore writes through these int64 row views of the pool buffers.
    dests = linker._wide_dest[pool.name]
    saved = {i: dests[i] for i in pool.layer_part_indices(1)}

    def admit(rid: str) -> Any:
        req = stack.make_req(rid, [*prefix, 7, 8])
        stack.enqueue(req)
        wait_until(lambda: linker.preparation_ready(stack.handle_of(req)), what=rid)
        req.init_next_round_input(cache)
        return req

    req = admit("copy-fault")
    sc.check("the prefix is an external hit", req.host_hit_length == len(prefix))
    stack.load_back(req)
    private = cache.linker.private_load_indices[req.rid].clone()
    for i in saved:
        dests[i] = _FailingRows(1)
    try:
        sc.check("the load batch starts", cache.ready_to_load_host_cache() >= 0)
        failed = cache.finish_external_linker_loads([req])
    finally:
        for i, rows in saved.items():
            dests[i] = rows
    reason = getattr(req.discard_output_reason, "message", None) or str(
        req.discard_output_reason
    )
    sc.check(
        "the failed request is reported", [r.rid for r in failed] == ["copy-fault"]
    )
    sc.check(
        "its output is discarded with a reason", req.discard_output_reason is not None
    )
    sc.check("its KV never enters the radix tree", req.skip_radix_cache_insert is True)
    layer1 = torch.cat(
        [
            buf[private].reshape(-1).view(torch.uint8)
            for buf in (kvcache.k_buffer[1], kvcache.v_buffer[1])
        ]
    )
    sc.check("layer 1 was never written", not layer1.any())
    cache.on_release(req, checkpointed=False)
    sc.check("claims released after the failed copy", settle(linker) == (0, 0))
    sc.check("the loader thread survived", linker._loader.is_alive())
    disabled = linker.stats.miss_restore_disabled
    req2 = admit("after-fault")
    sc.check(
        "later requests are clean misses (restores stopped)", req2.host_hit_length == 0
    )
    sc.check(
        "counted as restore_disabled", linker.stats.miss_restore_disabled > disabled
    )
    cache.on_release(req2, checkpointed=False)
    sc.output_matches_control = (
        bool(failed) and not layer1.any() and req2.host_hit_length == 0
    )
    sc.outcome = f"aborted with {reason!r}; later requests recompute"
    h.finish()


def scenario_reset_during_inflight(sc: Scenario, offload_path: str = "direct") -> None:
    """flush (reset) while an offload and a preparation are queued in KVCR: both
    resolve, nothing is claimed afterwards, no stale result pairs with a later
    offload, and the old pages are a clean miss."""
    h = Harness(sc)
    pool, lk = h.linker(offload_path=offload_path)
    stored = page_hashes(3, f"reset-{offload_path}")
    fill_pages(pool, [1, 2, 3, 4, 5], seed=41)
    sc.check("pages stored", offload_and_commit(lk, stored, [1, 2, 3]))
    inflight = page_hashes(2, f"reset-inflight-{offload_path}")
    threads_before = len(threading.enumerate())
    timings = []
    with owner_stalled(lk) as gate:
        lk.offload(kv_transfer(inflight, [4, 5]))
        handle = lk.prepare_request(ctx("r-reset"), kv_transfer(stored))
        lk.num_completed_offloads()  # pumps: a deferred deposit is submitted now
        wait_until(
            lambda: lk._adapter.stats().inflight_offload_bytes > 0,
            what="deposit handed to the owner",
        )
        sc.check("preparation in flight at the flush", not lk.preparation_ready(handle))
        threading.Timer(0.3, gate.set).start()
        started = time.monotonic()
        lk.reset()
        timings.append(time.monotonic() - started)
    sc.check("no offload result survives the flush", lk.num_completed_offloads() == 0)
    sc.check(
        "the dropped preparation is ready (nothing to wait for)",
        lk.preparation_ready(handle),
    )
    sc.check(
        "old pages are a clean miss", lk.lookup("r-reset", kv_transfer(stored)) == []
    )
    sc.check("the flushed KVCR holds no claims", settle(lk) == (0, 0))
    # Racing flushes: submit and reset at once, a few times.
    for i in range(3):
        lk.offload(kv_transfer(page_hashes(1, f"race{i}-{offload_path}"), [4]))
        lk.prepare_request(ctx(f"race{i}"), kv_transfer(stored))
        started = time.monotonic()
        lk.reset()
        timings.append(time.monotonic() - started)
        sc.check(f"race {i}: FIFO empty after flush", lk.num_completed_offloads() == 0)
    fill_pages(pool, [6], seed=42)
    fresh = page_hashes(1, f"reset-fresh-{offload_path}")
    ok = lk.offload(kv_transfer(fresh, [6]))
    wait_until(lambda: lk.num_completed_offloads() >= 1, what="fresh offload")
    sc.check("the next offload gets its own result", ok and lk.pop_completed_offload())
    sc.check("and only that one", lk.num_completed_offloads() == 0)
    prepare(lk, "fresh", fresh)
    ok = lk.lookup("fresh", kv_transfer(fresh)) == [1] and restore(
        lk, "fresh", fresh, [40]
    )
    matches = ok and page_bytes(pool, 40) == page_bytes(pool, 6)
    sc.check("the rebuilt KVCR restores byte-exact", matches)
    lk.finish_request("fresh")
    sc.check(
        "the owner thread was replaced, not added",
        len(threading.enumerate()) == threads_before,
    )
    sc.details["reset_s"] = [round(t, 3) for t in timings]
    sc.output_matches_control = matches
    sc.outcome = (
        f"4 flushes with work in flight ({offload_path}); max {max(timings):.2f} s"
    )
    h.finish()


def scenario_capacity_exhausted(sc: Scenario) -> None:
    """Every KVCR slot is claimed or filling: deposits fail, results keep their
    positions (a fast failure waits behind a slower success), failed pages are
    never reported as hits, and capacity returns once the claims are released."""
    h = Harness(sc)
    pool, lk = h.linker(local_dram_bytes_per_worker=4 * PAGE_BYTES)
    held = page_hashes(3, "cap-held")
    fill_pages(pool, list(range(1, 10)), seed=51)
    sc.check("three pages stored", offload_and_commit(lk, held, [1, 2, 3]))
    prepare(lk, "holder", held)
    sc.check(
        "a request claims all three",
        lk.lookup("holder", kv_transfer(held)) == [1, 2, 3],
    )
    s, f, g = (page_hashes(n, f"cap-{x}") for n, x in ((1, "s"), (1, "f"), (2, "g")))
    failures_before = lk.stats.offload_failures
    with owner_stalled(lk):
        # One deposit batch: S takes the last free slot; F and G find nothing to evict.
        lk.offload(kv_transfer(s, [4]))
        lk.offload(kv_transfer(f, [5]))
        lk.offload(kv_transfer([], []))
        lk.offload(kv_transfer(g, [6, 7]))
        lk.num_completed_offloads()  # pump: all three deposits queue behind the stall
    wait_until(lambda: lk.num_completed_offloads() == 4, what="four offload results")
    results = [lk.pop_completed_offload() for _ in range(4)]
    sc.details["results"] = results
    sc.check(
        "results in submission order [True, False, False, False]",
        results == [True, False, False, False],
    )
    sc.check(
        "two capacity failures counted",
        lk.stats.offload_failures - failures_before == 2,
    )
    sc.check("a failed page is never a hit", lk.lookup("probe-f", kv_transfer(f)) == [])
    ok = restore(lk, "holder", held, [20, 21, 22])
    matches = ok and [page_bytes(pool, p) for p in (20, 21, 22)] == [
        page_bytes(pool, p) for p in (1, 2, 3)
    ]
    sc.check("the claimed pages still restore byte-exact", matches)
    lk.finish_request("holder")
    sc.check(
        "capacity is back once claims are released", offload_and_commit(lk, g, [6, 7])
    )
    sc.output_matches_control = matches
    sc.outcome = f"results {results}; recovered after release"
    h.finish()


def scenario_offload_backpressure(sc: Scenario, offload_path: str = "direct") -> None:
    """max_inflight_offload_bytes bounds queued offload work: extra offloads fail at
    once and in position instead of queueing; the bound never grows the queue."""
    h = Harness(sc)
    limit = 2 * PAGE_BYTES
    pool, lk = h.linker(max_inflight_offload_bytes=limit, offload_path=offload_path)
    fill_pages(pool, list(range(1, 9)), seed=61)
    storm = 200
    rss0 = rss_mb()
    with owner_stalled(lk):
        for i in range(2):
            lk.offload(kv_transfer(page_hashes(1, f"bp-ok{i}-{offload_path}"), [1 + i]))
        lk.offload(kv_transfer(page_hashes(1, f"bp-over-{offload_path}"), [3]))
        lk.offload(kv_transfer(page_hashes(3, f"bp-big-{offload_path}"), [4, 5, 6]))
        for i in range(storm):
            lk.offload(kv_transfer(page_hashes(1, f"bp-storm{i}-{offload_path}"), [7]))
        lk.num_completed_offloads()  # pump: deferred deposits meet the budget now
        time.sleep(0.1)  # the staged path submits from its stager thread
        queued = lk._adapter._commands.qsize()
        deferred = len(getattr(lk, "_deferred_deposits", ()))
    total = 4 + storm
    wait_until(lambda: lk.num_completed_offloads() == total, what="all offload results")
    results = [lk.pop_completed_offload() for _ in range(total)]
    expected = [True, True] + [False] * (total - 2)
    sc.check(
        "results stay positional: two stored, the rest failed", results == expected
    )
    sc.details["queued_commands_at_peak"] = queued
    sc.details["deferred_after_pump"] = deferred
    sc.check("the owner's command queue stayed bounded (<= 2 deposits)", queued <= 2)
    after = lk._adapter.stats()
    refused = after.refused_offload + lk.stats.offload_staging_full
    sc.details["refused"] = refused
    sc.details["peak_offload_bytes"] = after.peak_offload_bytes
    sc.check("every extra offload was refused and counted", refused == total - 2)
    sc.check(
        "peak in-flight offload bytes within the bound",
        after.peak_offload_bytes <= limit,
    )
    sc.check("in-flight bytes return to zero", after.inflight_offload_bytes == 0)
    sc.details["storm_rss_growth_mb"] = round(rss_mb() - rss0, 1)
    prepare(lk, "bp", page_hashes(1, f"bp-ok0-{offload_path}"))
    ok = restore(lk, "bp", page_hashes(1, f"bp-ok0-{offload_path}"), [30])
    matches = ok and page_bytes(pool, 30) == page_bytes(pool, 1)
    sc.check("an accepted offload restores byte-exact", matches)
    lk.finish_request("bp")
    sc.output_matches_control = matches
    sc.outcome = f"{refused} of {total} offloads refused at once ({offload_path}); queue peak {queued}"
    h.finish()


def _no_connection(listener: socket.socket, wait_s: float) -> bool:
    readable, _, _ = select.select([listener], [], [], wait_s)
    if readable:
        conn, _ = listener.accept()
        conn.close()
        return False
    return True


def scenario_hint_outside_allowlist(
    sc: Scenario, positive_control: dict[str, Any] | None = None
) -> None:
    """A hint naming a peer outside peer_endpoint_allowlist never opens a
    connection: a listening socket there sees nothing while the request is prepared
    and looked up; the rejection is counted. (Positive control: the same hint with
    the listener allowed does connect; see unreachable_peer_close_retained.)"""
    h = Harness(sc)
    listen_wait = 1.0
    cases = []
    with contextlib.ExitStack() as stack:
        other = stack.enter_context(socket.socket())
        other.bind(("127.0.0.2", 0))
        other.listen(8)
        local = stack.enter_context(socket.socket())
        local.bind(("127.0.0.1", 0))
        local.listen(8)
        _, default_lk = h.linker()  # allowlist: its advertised host, 127.0.0.1
        _, ranged_lk = h.linker(peer_endpoint_allowlist=["127.0.0.1:1-1023"])
        cases = [
            (
                "other host",
                default_lk,
                other,
                f"tcp://127.0.0.2:{other.getsockname()[1]}",
            ),
            (
                "host name",
                default_lk,
                local,
                f"tcp://localhost:{local.getsockname()[1]}",
            ),
            (
                "port outside range",
                ranged_lk,
                local,
                f"tcp://127.0.0.1:{local.getsockname()[1]}",
            ),
        ]
        for i, (label, lk, listener, endpoint) in enumerate(cases):
            hashes = page_hashes(2, f"allow{i}")
            before = lk._hints.stats.rejected.copy()
            fetches = lk._adapter.stats().fetches
            handle = lk.prepare_request(
                ctx(f"allow{i}", fetch_hint(endpoint, hashes)), kv_transfer(hashes)
            )
            sc.check(f"{label}: ready at once", lk.preparation_ready(handle))
            sc.check(
                f"{label}: lookup is a miss",
                lk.lookup(f"allow{i}", kv_transfer(hashes)) == [],
            )
            sc.check(
                f"{label}: no connection within {listen_wait} s",
                _no_connection(listener, listen_wait),
            )
            sc.check(
                f"{label}: no KVCR fetch issued", lk._adapter.stats().fetches == fetches
            )
            counted = {
                r.value: n - before[r]
                for r, n in lk._hints.stats.rejected.items()
                if n - before[r]
            }
            sc.check(
                f"{label}: rejection counted", counted == {"endpoint_not_allowed": 1}
            )
            lk.finish_request(f"allow{i}")
    if positive_control is not None:
        sc.details["positive_control"] = {
            k: positive_control.get(k) for k in ("connected", "endpoint", "connect_s")
        }
        sc.check(
            "positive control: an allowlisted listener does get the connection",
            positive_control.get("connected") is True,
        )
    sc.output_matches_control = True  # nothing admitted; the control is a miss
    sc.outcome = f"{len(cases)} hints outside the allowlist: no connection, counted"
    h.finish()


IN_PROCESS: dict[str, Callable[[Scenario], None]] = {
    "stale_hint": scenario_stale_hint,
    "preparation_deadline_late_completions": scenario_preparation_deadline_late_completions,
    "failed_device_copy_mid_layer": scenario_failed_device_copy_mid_layer,
    "reset_during_inflight": scenario_reset_during_inflight,
    "reset_during_inflight_staged": lambda sc: scenario_reset_during_inflight(
        sc, "staged"
    ),
    "capacity_exhausted": scenario_capacity_exhausted,
    "offload_backpressure": scenario_offload_backpressure,
    "offload_backpressure_staged": lambda sc: scenario_offload_backpressure(
        sc, "staged"
    ),
}


# ---- real cache + wrapper stack (for the failed copy) -----------------------------


@dataclasses.dataclass
class Stack:
    cache: Any
    kvcache: Any
    allocator: Any
    linker: Any

    def insert_and_commit(
        self, tokens: list[int], seed: int
    ) -> tuple[Any, torch.Tensor]:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        slots = self.allocator.alloc(len(tokens))
        gen = torch.Generator().manual_seed(seed)
        for buf in kv_buffers(self.kvcache):
            buf[slots] = torch.randn(len(slots), HEADS, DIM, generator=gen).to(
                buf.dtype
            )
        original = torch.cat(
            [b[slots].reshape(-1).view(torch.uint8) for b in kv_buffers(self.kvcache)]
        ).clone()
        self.cache.insert(InsertParams(key=_radix_key(tokens), value=slots))

        def committed() -> bool:
            self.cache.check_hicache_events()
            return not self.cache.linker.pending_offloads

        wait_until(committed, what="offloads committed")
        return slots, original

    def evict(self, tokens: list[int]) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            MatchPrefixParams,
        )

        self.cache.evict(EvictParams(num_tokens=len(tokens)))
        match = self.cache.match_prefix(MatchPrefixParams(key=_radix_key(tokens)))
        assert match.device_prefix_len == 0

    @staticmethod
    def make_req(rid: str, tokens: list[int]) -> Any:
        from array import array

        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        return Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=1))

    def enqueue(self, req: Any) -> None:
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.scheduler import Scheduler

        sched = SimpleNamespace(
            tree_cache=self.cache,
            waiting_queue=[],
            disaggregation_mode=DisaggregationMode.NULL,
            processed_tokens_counter=0,
            _set_or_validate_priority=lambda r: True,
            _abort_on_queued_limit=lambda r: False,
            _prefetch_kvcache=lambda r: None,
        )
        Scheduler._add_request_to_queue(sched, req)

    @staticmethod
    def handle_of(req: Any) -> str:
        return ctx(req.rid, attempt=req.cache_request_handle.attempt_id).handle

    def load_back(self, req: Any) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        self.cache.init_load_back(
            InitLoadBackParams(
                best_match_node=req.best_match_node,
                host_hit_length=req.host_hit_length,
                req=req,
            )
        )


def _radix_key(tokens: list[int]) -> Any:
    from array import array

    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens))


def build_stack(**cfg: Any) -> Stack:
    """A real pool, allocator, UnifiedRadixCache (Python tree core) and a linker made
    the production way (``create_unified_cache_linker(backend="kvcr")``)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()  # before the factory is used: the plugin wraps it
    from cpu_harness import kvcr_stack

    config = {**BASE_CONFIG, "preparation_timeout_ms": 10_000, **cfg}
    s = kvcr_stack.build_stack(
        config, kvcr_stack.Geometry(PAGE, LAYERS, HEADS, DIM, POOL_TOKENS)
    )
    return Stack(s.cache, s.kvcache, s.allocator, s.linker)


# ---- 1b. peer processes ----------------------------------------------------------


def _child_main(conn: Any) -> None:
    """A spawned child: imports once, then builds a peer linker or runs a child
    scenario on request (see ``Child``)."""
    code = 0
    try:
        logging.basicConfig(level=logging.WARNING, format="child %(name)s: %(message)s")
        import kvcr  # noqa: F401
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: F401

        from sglang.srt.mem_cache.storage.kvcr import kvcr_direct_linker  # noqa: F401

        conn.send(("imported", os.getpid()))
        linker = None
        while True:
            if not conn.poll(1.0):
                if os.getppid() == 1:
                    break  # the parent died
                continue
            cmd, arg = conn.recv()
            if cmd == "build":
                pool = make_pool()
                linker = make_linker(pool, **{**PEER_CONFIG, **arg["config"]})
                out = {}
                for group, hashes in arg["groups"].items():
                    pages = list(range(1, 1 + len(hashes)))
                    fill_pages(pool, pages, seed=arg["seed"] + len(out))
                    ok = offload_and_commit(linker, hashes, pages)
                    out[group] = {
                        "stored": ok,
                        "bytes": [page_bytes(pool, p) for p in pages],
                    }
                conn.send(("ready", {"endpoint": linker.endpoint, "groups": out}))
            elif cmd == "run":
                conn.send(("result", CHILD_SCENARIOS[arg]()))
            elif cmd == "close":  # close the peer linker, stay available
                if linker is not None:
                    linker.close()
                    linker = None
                conn.send(("closed", retained_count()))
            elif cmd == "stop":
                if linker is not None:
                    linker.close()
                conn.send(("stopped", retained_count()))
                break
    except BaseException:
        code = 1
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip native teardown (torch, UCX), which takes seconds on a busy machine.
        os._exit(code)


class Child:
    """A spawned process driven over a Pipe; every wait is bounded."""

    def __init__(self, name: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_end = context.Pipe()
        self.proc = context.Process(
            target=_child_main, args=(child_end,), name=name, daemon=True
        )
        self.proc.start()
        child_end.close()
        self.name = name
        self._imported = False

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)

    def _recv(self, timeout: float) -> tuple[str, Any]:
        if not self.conn.poll(timeout):
            raise AssertionError(f"{self.name}: no answer within {timeout} s")
        kind, value = self.conn.recv()
        if kind == "error":
            raise AssertionError(f"{self.name} failed:\n{value}")
        return kind, value

    def wait_imported(self, timeout: float = CHILD_START_S) -> None:
        if not self._imported:
            kind, _ = self._recv(timeout)
            assert kind == "imported", kind
            self._imported = True

    def build(
        self, config: dict[str, Any], groups: dict[str, list[str]], seed: int
    ) -> dict[str, Any]:
        self.wait_imported()
        self.conn.send(("build", {"config": config, "groups": groups, "seed": seed}))
        kind, value = self._recv(60.0)
        assert kind == "ready", kind
        return value

    def run(self, scenario: str, timeout: float = 90.0) -> dict[str, Any]:
        self.wait_imported()
        self.conn.send(("run", scenario))
        kind, value = self._recv(timeout)
        assert kind == "result", kind
        return value

    def close_linker(self, timeout: float = 30.0) -> int:
        """Close the child's peer linker (it stays up); returns its retained count."""
        self.conn.send(("close", None))
        kind, retained = self._recv(timeout)
        assert kind == "closed", kind
        return int(retained)

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def stop(self, timeout: float = 30.0) -> int | None:
        """Ask the child to close its linker and exit; returns its retained count."""
        retained = None
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self.conn.send(("stop", None))
                _, retained = self._recv(timeout)
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        return retained

    def kill(self) -> None:
        if self.proc.is_alive():
            self.signal(signal.SIGKILL)
        self.proc.join(10)


def _child_unreachable_peer() -> dict[str, Any]:
    """In a child: B's hint names an allowlisted endpoint where only a raw TCP
    listener answers (a peer that never speaks KVCR). KVCR connects (the allowlist
    positive control), the fetch fails, the request is a miss with no claim, and
    KVCR keeps the quarantined operation: close() cannot be clean, and the adapter
    retains the instance (kvcr 0.1.1 behaviour, reference §4.4)."""
    out: dict[str, Any] = {
        "threads_before": sorted(t.name for t in threading.enumerate())
    }
    baseline = set(threading.enumerate())
    capture = LogCapture()
    with socket.socket() as listener, capture.attached():
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        out["endpoint"] = endpoint
        pool = make_pool()
        lk = make_linker(pool)
        hashes = page_hashes(2, "unreachable")
        started = time.monotonic()
        handle = lk.prepare_request(
            ctx("u", fetch_hint(endpoint, hashes)), kv_transfer(hashes)
        )
        readable, _, _ = select.select([listener], [], [], 5.0)
        out["connected"] = bool(readable)
        out["connect_s"] = round(time.monotonic() - started, 3)
        held = []
        if readable:
            held.append(listener.accept()[0])  # keep it open and silent
        wait_until(lambda: lk.preparation_ready(handle), what="unreachable prepared")
        out["ready_s"] = round(time.monotonic() - started, 3)
        out["lookup"] = lk.lookup("u", kv_transfer(hashes))
        lk.finish_request("u")
        out["claims"] = list(settle(lk))
        # The quarantine is reported through KVCR's resilience callback.
        with contextlib.suppress(AssertionError):
            wait_until(
                lambda: lk._adapter.stats().resilience_events > 0, 10.0, "resilience"
            )
        out["resilience_events"] = lk._adapter.stats().resilience_events
        started = time.monotonic()
        close_error = ""
        try:
            lk.close()
        except Exception as exc:
            close_error = repr(exc)
        out["close_s"] = round(time.monotonic() - started, 2)
        out["close_error"] = close_error
        out["retained"] = retained_count()
        for conn in held:
            conn.close()
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not (set(threading.enumerate()) - baseline), THREAD_SETTLE_S)
    out["threads_left"] = sorted(
        t.name for t in set(threading.enumerate()) - baseline if t.is_alive()
    )
    out["os_threads"] = len(os.listdir("/proc/self/task"))
    out["log_not_clean"] = capture.count("close was not clean")
    out["log_uncertain"] = capture.count("state=uncertain")
    return out


CHILD_SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "unreachable_peer": _child_unreachable_peer,
}


def scenario_unreachable_peer_close_retained(
    sc: Scenario, result: dict[str, Any]
) -> None:
    """Judge the child's dead-peer run (see ``_child_unreachable_peer``)."""
    sc.details.update(result)
    sc.check("KVCR dialled the allowlisted endpoint", result["connected"])
    sc.check("the request is a miss", result["lookup"] == [])
    sc.check("no claims held", result["claims"] == [0, 0])
    sc.claims_leaked = sum(result["claims"])
    sc.check(
        "the quarantine is reported (resilience event)",
        result["resilience_events"] >= 1,
    )
    sc.check(
        "close() returns; KVCR resources are retained, as documented",
        not result["close_error"] and result["retained"] == 1,
    )
    sc.check(
        "only KVCR's own threads may remain",
        all(name.startswith("kvcr") for name in result["threads_left"]),
    )
    sc.output_matches_control = result["lookup"] == []
    sc.outcome = (
        f"miss after {result['ready_s']} s; close {result['close_s']} s, "
        f"retained={result['retained']}, threads left {result['threads_left']}"
    )


@dataclasses.dataclass
class PeerChildren:
    """The peer processes of the peer scenarios, spawned early so their imports
    overlap with other work. The restarted peer's process, once its linker is
    closed, also hosts the unreachable-peer scenario."""

    first: Child
    restarted: Child

    @classmethod
    def spawn(cls) -> PeerChildren:
        return cls(Child("peer-A"), Child("peer-A-restarted"))

    def close(self) -> None:
        for child in (self.first, self.restarted):
            child.kill()


def run_peer_scenarios(children: PeerChildren) -> list[Scenario]:
    """frozen/resumed, killed mid-fetch, restarted on the same endpoint (B here,
    A in children), then the unreachable peer (B in a child)."""
    frozen = Scenario("peer_frozen_resumed")
    killed = Scenario("peer_killed_mid_fetch")
    restarted = Scenario("peer_restarted_same_endpoint")
    flush = Scenario("flush_with_quarantined_peer_op")
    dead = Scenario("unreachable_peer_close_retained")
    started = time.monotonic()
    capture = LogCapture()
    harnesses: list[Harness] = []
    try:
        with capture.attached():
            _peer_sequence(
                children, capture, harnesses, frozen, killed, restarted, flush
            )
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        current = next(
            (s for s in (frozen, killed, restarted, flush) if not s.outcome), flush
        )
        current.error = traceback.format_exc()
    finally:
        for h in harnesses:  # after a failure: close what is still open
            for lk in h.linkers:
                with contextlib.suppress(Exception):
                    h.close(lk)
        children.first.kill()
    for sc in (frozen, killed, restarted, flush):
        sc.wall_s = time.monotonic() - started
        if not sc.checks and not sc.error:
            sc.error = "not reached"
    t0 = time.monotonic()
    try:
        children.restarted.close_linker()
        result = children.restarted.run("unreachable_peer")
        scenario_unreachable_peer_close_retained(dead, result)
    except BaseException:
        dead.error = traceback.format_exc()
    finally:
        children.restarted.kill()
    dead.wall_s = time.monotonic() - t0
    return [frozen, killed, restarted, flush, dead]


def _peer_sequence(
    children: PeerChildren,
    capture: LogCapture,
    harnesses: list[Harness],
    frozen: Scenario,
    killed: Scenario,
    restarted: Scenario,
    flush: Scenario,
) -> None:
    """One peer A (child) serves B (here) through a short freeze, a long freeze and
    SIGCONT; then A is frozen and killed with fetches in flight from B (connected to
    A long before) and from B2 (a fresh linker that never completed a handshake
    with A); then A2 starts on A's endpoint."""
    port = free_port()
    groups = {
        g: page_hashes(3, f"peer-{g}") for g in ("short", "long", "resumed", "kill")
    }
    a = children.first
    peer = a.build({"control_port": port}, groups, seed=71)
    endpoint = peer["endpoint"]
    stored = {g: v["bytes"] for g, v in peer["groups"].items()}
    h_frozen = Harness(frozen)
    harnesses.append(h_frozen)
    pool_b, b = h_frozen.linker()
    op_timeout = BASE_CONFIG["operation_timeout_ms"] / 1000.0
    dest = iter(range(8, 50, 3))

    def restore_matches(
        lk: Any, pool: Any, rid: str, hashes: list[str], expected: list[bytes]
    ) -> bool:
        start = next(dest)
        pages = [start, start + 1, start + 2][: len(hashes)]
        ok = restore(lk, rid, hashes, pages)
        return ok and [page_bytes(pool, p) for p in pages] == expected

    # -- frozen, then resumed within B's operation timeout: the fetch completes.
    g = groups["short"]
    a.signal(signal.SIGSTOP)
    timer = threading.Timer(0.4, a.signal, args=(signal.SIGCONT,))
    timer.start()
    took = prepare(b, "short", g, fetch_hint(endpoint, g))
    timer.join()
    hit = b.lookup("short", kv_transfer(g))
    frozen.check("short freeze: B waited for the peer", took >= 0.35)
    frozen.check("short freeze: full hit", hit == [1, 2, 3])
    short_ok = hit == [1, 2, 3] and restore_matches(
        b, pool_b, "short", g, stored["short"]
    )
    frozen.check("short freeze: restored bytes equal A's", short_ok)
    b.finish_request("short")
    # -- frozen past B's operation timeout: a miss; after SIGCONT A serves again.
    g = groups["long"]
    a.signal(signal.SIGSTOP)
    try:
        took_long = prepare(b, "long", g, fetch_hint(endpoint, g))
        long_hit = b.lookup("long", kv_transfer(g))
        b.finish_request("long")
        frozen.check(
            "long freeze: the fetch gave up at the operation timeout",
            took_long >= op_timeout * 0.9,
        )
        frozen.check(
            "long freeze: a miss, nothing claimed",
            long_hit == [] and settle(b) == (0, 0),
        )
    finally:
        a.signal(signal.SIGCONT)
    time.sleep(0.5)
    g = groups["resumed"]
    prepare(b, "resumed", g, fetch_hint(endpoint, g))
    resumed_hit = b.lookup("resumed", kv_transfer(g))
    resumed_ok = resumed_hit == [1, 2, 3] and restore_matches(
        b, pool_b, "resumed", g, stored["resumed"]
    )
    frozen.check("after SIGCONT: the peer serves again, byte-exact", resumed_ok)
    b.finish_request("resumed")
    frozen.check("no claims held", settle(b) == (0, 0))
    frozen.check("no quarantine from a freeze", capture.count("state=uncertain") == 0)
    frozen.output_matches_control = short_ok and resumed_ok and long_hit == []
    frozen.outcome = (
        f"0.4 s freeze: hit after {took:.2f} s; {took_long:.2f} s freeze: miss; "
        "after SIGCONT: hit"
    )

    # -- killed while fetches are in flight from B and from a fresh B2.
    h_killed = Harness(killed)
    harnesses.append(h_killed)
    pool_b2, b2 = h_killed.linker()
    g = groups["kill"]
    a.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    handles = {}
    for name, lk in (("B", b), ("B2", b2)):
        fetches = lk._adapter.stats().fetches
        handles[name] = lk.prepare_request(
            ctx("kill", fetch_hint(endpoint, g)), kv_transfer(g)
        )
        wait_until(
            lambda lk=lk, n=fetches: lk._adapter.stats().fetches > n,
            what="fetch submitted",
        )
    time.sleep(0.1)
    in_flight = [lk._adapter.stats().inflight_prepare_bytes for lk in (b, b2)]
    killed.check("both fetches are in flight when the peer dies", all(in_flight))
    a.kill()
    for name, lk in (("B", b), ("B2", b2)):
        wait_until(
            lambda lk=lk, name=name: lk.preparation_ready(handles[name]),
            what="killed-peer prepare",
        )
    kill_s = time.monotonic() - t0
    kill_hits = [lk.lookup("kill", kv_transfer(g)) for lk in (b, b2)]
    killed.check("a miss on both, never partial KV", kill_hits == [[], []])
    for lk in (b, b2):
        lk.finish_request("kill")
    killed.check("no claims held", settle(b) == (0, 0) and settle(b2) == (0, 0))
    with contextlib.suppress(AssertionError):
        wait_until(lambda: capture.count("state=uncertain") > 0, 10.0, "quarantine")
    uncertain = capture.count("state=uncertain")
    killed.details["quarantined_ops_reported"] = uncertain
    killed.check("KVCR reports the dead peer's operation quarantined", uncertain >= 1)
    # B keeps working locally while the quarantine stands.
    stored, local_ok = local_round_trip(b, pool_b, "peer-local", 60, 61, seed=73)
    killed.check("B still offloads", stored)
    killed.check("B still restores its own pages byte-exact", local_ok)
    killed.claims_leaked = sum(settle(b)) + sum(settle(b2))
    killed.output_matches_control = kill_hits == [[], []] and local_ok
    killed.outcome = (
        f"miss after {kill_s:.2f} s on both; quarantined; local path unaffected"
    )

    # -- a new peer on the same endpoint (different bytes for a new group).
    fresh = page_hashes(3, "peer-restarted")
    peer2 = children.restarted.build({"control_port": port}, {"fresh": fresh}, seed=91)
    restarted.check("A2 listens on A's endpoint", peer2["endpoint"] == endpoint)
    expected = peer2["groups"]["fresh"]["bytes"]
    attempts: dict[str, int] = {}
    ok_by: dict[str, bool] = {}
    for name, lk, pool in (("B", b, pool_b), ("B2", b2, pool_b2)):
        hit, n = [], 0
        while n < 3 and hit != [1, 2, 3]:
            n += 1
            rid = f"restart-{name}-{n}"
            prepare(lk, rid, fresh, fetch_hint(endpoint, fresh))
            hit = lk.lookup(rid, kv_transfer(fresh))
            if hit != [1, 2, 3]:
                lk.finish_request(rid)
        attempts[name] = n
        ok_by[name] = hit == [1, 2, 3] and restore_matches(
            lk, pool, rid, fresh, expected
        )
        lk.finish_request(rid)
        prepare(lk, f"stale-{name}", g, fetch_hint(endpoint, g))
        ok_by[name] = ok_by[name] and lk.lookup(f"stale-{name}", kv_transfer(g)) == []
        lk.finish_request(f"stale-{name}")
    restarted.details["attempts_until_hit"] = attempts
    restarted.check(
        "B gets A2's bytes (not A's), the dead peer's pages miss", ok_by["B"]
    )
    restarted.check("B2 gets A2's bytes, the dead peer's pages miss", ok_by["B2"])
    restarted.check(
        "at most one refused attempt (incarnation mismatch)",
        max(attempts.values()) <= 2,
    )
    with contextlib.suppress(AssertionError):
        wait_until(lambda: capture.count("state=quiesced") > 0, 5.0, "quiesced")
    restarted.details["quiesced_reports"] = capture.count("state=quiesced")
    retained0 = retained_count()
    h_killed.finish()  # B2 must close cleanly
    b2_clean = retained_count() == retained0
    restarted.check("B2 (its start_write was still queued) closes cleanly", b2_clean)
    restarted.check("A2 closes cleanly", children.restarted.close_linker() == 0)
    restarted.output_matches_control = ok_by["B"] and ok_by["B2"]

    # -- flush B, whose KVCR may still hold the dead peer's quarantined operation.
    retained0, q0 = retained_count(), b.quarantined_bytes()
    t0 = time.monotonic()
    b.reset()
    flush_s = time.monotonic() - t0
    old_retained = retained_count() - retained0
    quarantined = b.quarantined_bytes() - q0
    flush.details.update(
        {
            "flush_s": round(flush_s, 2),
            "old_kvcr_retained": old_retained,
            "quarantined_bytes": quarantined,
        }
    )
    flush.check(
        "the flush returns within owner_wait_timeout_s",
        flush_s < BASE_CONFIG["owner_wait_timeout_s"],
    )
    flush.check(
        "old DRAM is quarantined exactly when the old KVCR could not close",
        (old_retained == 1) == (quarantined > 0) and old_retained <= 1,
    )
    flush.check(
        "pages fetched before the flush are a miss",
        b.lookup("gone", kv_transfer(fresh)) == [],
    )
    stored, flush_ok = local_round_trip(b, pool_b, "after-flush", 62, 63, seed=97)
    flush.check("the new KVCR stores", stored)
    flush.check("the new KVCR restores byte-exact", flush_ok)
    flush.claims_leaked = sum(settle(b))
    retained0 = retained_count()
    h_frozen.finish(allow_retained=True)
    flush.check("the rebuilt KVCR closes cleanly", retained_count() == retained0)
    flush.output_matches_control = flush_ok
    flush.outcome = (
        f"flush in {flush_s:.2f} s; old KVCR "
        f"{'retained, ' + str(quarantined) + ' DRAM bytes quarantined' if old_retained else 'closed clean'}; "
        "new KVCR serves and closes clean"
    )
    restarted.details["b_quarantine_persisted"] = bool(old_retained)
    restarted.outcome = (
        f"A2 served B after {attempts['B']} attempt(s), B2 after {attempts['B2']}; "
        f"dead peer's pages missed; B2 closed clean; B's quarantine "
        f"{'persisted (its start_write had reached A)' if old_retained else 'cleared'}"
    )


# ---- 2. soak on two CPU servers ---------------------------------------------------


def _scheduler_pids(handle: Any) -> list[int]:
    import psutil

    try:
        procs = psutil.Process(handle.process.pid).children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if "scheduler" in " ".join(proc.cmdline()) or "scheduler" in proc.name():
                out.append(proc.pid)
    return out


def _stats_of(line: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)", line)}


def _final_stats(log: str) -> list[dict[str, int]]:
    """The last KVCR_STATS line of each rank (TPn prefix), parsed."""
    last: dict[str, str] = {}
    for m in re.finditer(r"^.*?(TP\d+)?\] KVCR_STATS (.*)$", log, re.M):
        last[m.group(1) or "TP0"] = m.group(2)
    return [_stats_of(last[k]) for k in sorted(last)]


def run_soak(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from cpu_harness import server as harness
    from cpu_harness.tiny_model import ensure_tiny_model
    from sglang.srt.mem_cache.storage.kvcr.router_hint import page_hash_to_u64

    page = 16
    model = ensure_tiny_model()
    ctl = {"A": free_port(), "B": free_port()}
    endpoints = {k: f"tcp://127.0.0.1:{p}" for k, p in ctl.items()}
    servers: dict[str, Any] = {}
    out: dict[str, Any] = {"requests": 0, "passed": False}
    t0 = time.monotonic()
    try:
        for name in ("A", "B"):
            config = {
                "local_dram_bytes_per_worker": 1 << 20,  # 256 pages: KVCR evicts
                "control_port": ctl[name],
                "operation_timeout_ms": 5000,
                "abandon_timeout_ms": 10000,
                "preparation_timeout_ms": 5000,
            }
            servers[name] = harness.launch_server(
                [
                    "--page-size",
                    str(page),
                    "--max-total-tokens",
                    "2048",  # the device pool evicts
                    "--max-running-requests",
                    "8",
                    *harness.kvcr_linker_args(config),
                ],
                model_path=model,
                log_path=work / f"soak_{name}.log",
                wait=False,
            )
        for handle in servers.values():
            handle.wait_ready(args.startup_timeout)
        out["startup_s"] = round(time.monotonic() - t0, 1)
        rng = random.Random(args.seed)
        prefixes = [[rng.randrange(3, 300) for _ in range(6 * page)] for _ in range(48)]
        suffixes = [[rng.randrange(3, 300) for _ in range(page)] for _ in range(3)]
        prefix_hashes = [
            [
                page_hash_to_u64(x)
                for x in get_storage_hash_str(RadixKey(p), None, page_size=page)
            ]
            for p in prefixes
        ]
        outputs: dict[tuple[int, int], list[int]] = {}
        lock = threading.Lock()
        counters = {
            "mismatches": 0,
            "hinted": 0,
            "external_hits": 0,
            "hinted_hits": 0,
            "peer_hits": 0,
            "errors": 0,
        }
        errors: list[str] = []
        sent: dict[str, set[int]] = {"A": set(), "B": set()}  # prefixes per server

        def one(i: int) -> None:
            r = random.Random(args.seed * 1000003 + i)
            target = "A" if r.random() < 0.5 else "B"
            other = "B" if target == "A" else "A"
            pi, si = r.randrange(len(prefixes)), r.randrange(len(suffixes))
            extra: dict[str, Any] = {}
            hinted = r.random() < 0.25
            with lock:  # never sent here before: a hit can only come from the peer
                first_here = pi not in sent[target]
                sent[target].add(pi)
            if hinted:
                extra["kv_hints"] = {
                    "protocol_version": "1.0",
                    "message_id": f"soak-{i}",
                    "actions": [
                        {
                            "action_id": "fetch-0",
                            "action_type": "kv.fetch",
                            "action_version": "1.0",
                            "payload": {
                                "source_control_endpoint": endpoints[other],
                                "block_hashes": prefix_hashes[pi],
                            },
                        }
                    ],
                }
            try:
                res = servers[target].generate(
                    input_ids=prefixes[pi] + suffixes[si],
                    max_new_tokens=4,
                    timeout=120,
                    **extra,
                )
            except Exception as exc:
                with lock:
                    counters["errors"] += 1
                    errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
                return
            ids = list(res.get("output_ids") or [])
            details = res.get("meta_info", {}).get("cached_tokens_details") or {}
            with lock:
                counters["hinted"] += hinted
                if int(details.get("host", 0) or 0) > 0:
                    counters["external_hits"] += 1
                    counters["hinted_hits"] += hinted
                    counters["peer_hits"] += hinted and first_here
                first = outputs.setdefault((pi, si), ids)
                if first != ids:
                    counters["mismatches"] += 1

        with concurrent.futures.ThreadPoolExecutor(args.soak_concurrency) as pool:
            list(pool.map(one, range(-args.soak_warmup, 0)))
        time.sleep(1.0)
        sched = {k: _scheduler_pids(h) for k, h in servers.items()}
        rss_start = {k: sum(rss_mb(p) for p in pids) for k, pids in sched.items()}
        out["scheduler_pids"] = sched
        for key in counters:
            counters[key] = 0
        t1 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.soak_concurrency) as pool:
            list(pool.map(one, range(args.soak_requests)))
        out["soak_s"] = round(time.monotonic() - t1, 1)
        time.sleep(2.0)  # let offloads and releases of the last requests drain
        rss_end = {k: sum(rss_mb(p) for p in pids) for k, pids in sched.items()}
        out["requests"] = args.soak_requests
        out["warmup_requests"] = args.soak_warmup
        out["rss_start_mb"] = round(sum(rss_start.values()), 1)
        out["rss_end_mb"] = round(sum(rss_end.values()), 1)
        out["rss_per_server_mb"] = {
            k: [round(rss_start[k], 1), round(rss_end[k], 1)] for k in servers
        }
        out.update(counters)
        out["error_samples"] = errors[:5]
        out["distinct_prompts"] = len(outputs)
    finally:
        for handle in servers.values():
            handle.stop()
    logs = {k: h.log_text() for k, h in servers.items()}
    finals = {k: _final_stats(text) for k, text in logs.items()}
    out["final_stats"] = {
        k: {
            f: s.get(f)
            for f in (
                "claims_held",
                "abandoned_bytes",
                "hit_pages",
                "evicted_pages",
                "loads",
                "load_failures",
                "offload_failures",
                "prepared",
            )
        }
        for k, stats in finals.items()
        for s in stats[-1:]
    }
    out["claims_held_end"] = sum(
        s.get("claims_held", 0) for v in finals.values() for s in v
    )
    out["quarantined_bytes_end"] = sum(
        s.get("abandoned_bytes", 0) + s.get("quarantined_bytes", 0)
        for v in finals.values()
        for s in v
    )
    out["unclean_closes"] = sum(t.count("close was not clean") for t in logs.values())
    out["tracebacks"] = sum(t.count("Traceback") for t in logs.values())
    out["logs"] = {k: str(h.log_path) for k, h in servers.items()}
    rss_ok = (
        all(rss_end[k] <= 1.2 * rss_start[k] for k in servers)
        if out.get("rss_start_mb")
        else False
    )
    out["checks"] = {
        "rss end <= 1.2 x start (each server)": rss_ok,
        "0 claims held at the end": out["claims_held_end"] == 0
        and all(finals.values()),
        "0 abandoned/quarantined bytes at the end": out["quarantined_bytes_end"] == 0,
        "every request completed": out.get("errors", 1) == 0,
        "repeated prompts give identical greedy outputs": out.get("mismatches", 1) == 0,
        "external (KVCR) hits happened": out.get("external_hits", 0) > 0,
        "hinted peer hits happened (prefix never sent to that server)": out.get(
            "peer_hits", 0
        )
        > 0,
        "KVCR evicted pages (pressure reached)": any(
            (s.get("evicted_pages") or 0) > 0 for s in out["final_stats"].values()
        ),
        "no unclean KVCR close, no traceback": out["unclean_closes"] == 0
        and out["tracebacks"] == 0,
    }
    out["passed"] = all(out["checks"].values())
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


# ---- 3. fuzz -----------------------------------------------------------------------


def run_fuzz(examples: int, work: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    report = work / "fuzz.jsonl"
    report.unlink(missing_ok=True)
    env = {
        **os.environ,
        "KVCR_FUZZ_EXAMPLES": str(examples),
        "KVCR_FUZZ_REPORT": str(report),
    }
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(
                REPO
                / "test"
                / "registered"
                / "unit"
                / "mem_cache"
                / "test_kvcr_fuzz.py"
            ),
        ],
        cwd=str(REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    rows = []
    if report.exists():
        rows = [json.loads(line) for line in report.read_text().splitlines() if line]
    meta = {
        "pytest_rc": proc.returncode,
        "wall_s": round(time.monotonic() - started, 1),
        "tail": proc.stdout[-1500:],
    }
    return rows, meta


# ---- 4. TP=2 -------------------------------------------------------------------


def run_tp2(args: argparse.Namespace, work: Path) -> Scenario:
    from cpu_harness import server as harness
    from cpu_harness.tiny_model import ensure_tiny_model

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
        finals = _final_stats(handle.log_text())
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


# ---- driver --------------------------------------------------------------------


def run_fast_scenarios(names: list[str] | None = None) -> list[Scenario]:
    """Every in-process scenario and the peer group, in the order ``make test`` uses."""
    children = PeerChildren.spawn()  # imports overlap with the in-process work
    results = []
    try:
        for name, body in IN_PROCESS.items():
            if names is None or name in names:
                results.append(run_scenario(name, body))
        peers = run_peer_scenarios(children)
    finally:
        children.close()
    control = next(s for s in peers if s.name == "unreachable_peer_close_retained")
    if names is None or "hint_outside_allowlist" in names:
        results.append(
            run_scenario(
                "hint_outside_allowlist",
                lambda sc: scenario_hint_outside_allowlist(sc, control.details or None),
            )
        )
    return results + peers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", default="", help="report path (default under .cache)")
    p.add_argument("--soak-requests", type=int, default=2000)
    p.add_argument("--soak-warmup", type=int, default=120)
    p.add_argument("--soak-concurrency", type=int, default=4)
    p.add_argument("--fuzz-examples", type=int, default=10_000)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--skip",
        default="",
        help="comma-separated parts to skip: scenarios,soak,fuzz,tp2",
    )
    args = p.parse_args(argv)
    unknown = set(filter(None, args.skip.split(","))) - {
        "scenarios",
        "soak",
        "fuzz",
        "tp2",
    }
    if unknown:
        p.error(f"--skip: unknown {sorted(unknown)}")
    if args.soak_requests < 1 or args.fuzz_examples < 1:
        p.error("--soak-requests and --fuzz-examples must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s"
    )
    from cpu_harness import server as harness

    work = Path(args.report).parent if args.report else harness.cache_dir() / "faults"
    work.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    timings: dict[str, float] = {}
    started = time.monotonic()
    scenarios: list[Scenario] = []
    soak: dict[str, Any] = {"requests": 0, "passed": False, "skipped": "soak" in skip}
    fuzz: list[dict[str, Any]] = []
    fuzz_meta: dict[str, Any] = {}

    def phase(name: str, fn: Callable[[], Any]) -> Any:
        t = time.monotonic()
        print(f"[faults] {name} ...", flush=True)
        try:
            return fn()
        finally:
            timings[name] = round(time.monotonic() - t, 1)
            print(f"[faults] {name} done in {timings[name]} s", flush=True)

    if "scenarios" not in skip:
        scenarios = phase("scenarios", run_fast_scenarios)
        for sc in scenarios:
            print(f"[faults]   {sc.summary()}", flush=True)
    if "fuzz" not in skip:
        fuzz, fuzz_meta = phase("fuzz", lambda: run_fuzz(args.fuzz_examples, work))
        for row in fuzz:
            print(f"[faults]   fuzz {row}", flush=True)
    if "tp2" not in skip:
        tp2 = phase("tp2", lambda: run_tp2(args, work))
        print(f"[faults]   {tp2.summary()}", flush=True)
        scenarios.append(tp2)
    if "soak" not in skip:
        soak = phase("soak", lambda: run_soak(args, work))
        print(
            f"[faults]   soak: {'PASS' if soak['passed'] else 'FAIL'} "
            + json.dumps(
                {
                    k: soak.get(k)
                    for k in (
                        "requests",
                        "rss_start_mb",
                        "rss_end_mb",
                        "claims_held_end",
                        "quarantined_bytes_end",
                        "external_hits",
                        "peer_hits",
                        "mismatches",
                        "errors",
                    )
                }
            ),
            flush=True,
        )
    wall = time.monotonic() - started
    fuzz_ok = "fuzz" in skip or (
        bool(fuzz)
        and fuzz_meta.get("pytest_rc") == 0
        and all(
            r["failures"] == 0 and r["examples"] >= args.fuzz_examples for r in fuzz
        )
    )
    ok = (
        all(sc.passed for sc in scenarios)
        and ("soak" in skip or soak["passed"])
        and fuzz_ok
    )
    body = {
        "passed": ok,
        "scenarios": [sc.as_dict() for sc in scenarios],
        "soak": soak,
        "fuzz": fuzz,
        "fuzz_run": fuzz_meta,
        "timings_s": {**timings, "total": round(wall, 1)},
        "config": dict(vars(args)),
        "env": {
            k: os.environ.get(k, "")
            for k in ("UCX_NET_DEVICES", "UCX_TLS", "NIXL_LOG_LEVEL")
        },
        "cpus": os.cpu_count(),
    }
    path = Path(args.report) if args.report else work / "kvcr_faults_report.json"
    path.write_text(json.dumps(body, indent=2, default=str))
    print()
    print(
        f"{'scenario':<40} {'result':<7} {'claims':>6} {'output=control':>15} {'wall_s':>7}"
    )
    for sc in scenarios:
        print(
            f"{sc.name:<40} {'PASS' if sc.passed else 'FAIL':<7} {sc.claims_leaked:>6} "
            f"{sc.output_matches_control!s:>15} {sc.wall_s:>7.1f}"
        )
    print(f"overall: {'PASS' if ok else 'FAIL'} in {wall:.1f} s")
    print(f"REPORT {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
