"""What every fault scenario shares: its record, its harness, bounded waits.

The pages, pool and linker are ``cpu_harness.kvcr_pages``'s (page 4, 2 layers, 2
KV heads, dim 8, 64 pool pages); this module adds the fault driver's settings
(timeouts with room for a loaded 2-core machine), the probes of what a scenario
leaves behind (claims in the linker and in KVCR, threads, RSS, retained KVCR
instances) and the ``Scenario`` verdict the report and the registered tests read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cpu_harness import kvcr_pages
from cpu_harness.kvcr_pages import (
    PAGE_BYTES,
    hashes_for,
    kv_transfer,
    make_linker,
    wait_until,
)

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


def page_data(pool: Any, page: int) -> bytes:
    """Every K and V byte of ``page``, as bytes (compared and sent between processes)."""
    return kvcr_pages.page_bytes(pool, page).numpy().tobytes()


def ctx(rid: str, hint: Any = None, attempt: int = 0) -> Any:
    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
        LinkerRequestContext,
    )

    return LinkerRequestContext(rid, attempt, hint)


def offload_and_commit(linker: Any, hashes: list[str], pages: list[int]) -> bool:
    return bool(kvcr_pages.offload_and_commit(linker, hashes, pages))


def prepare(linker: Any, rid: str, hashes: list[str], hint: Any = None) -> float:
    """prepare_request then poll preparation_ready; returns the seconds it took."""
    started = time.monotonic()
    handle = linker.prepare_request(ctx(rid, hint), kv_transfer(hashes))
    wait_until(lambda: linker.preparation_ready(handle), WAIT_S, f"{rid} prepared")
    return time.monotonic() - started


def restore(linker: Any, rid: str, hashes: list[str], pages: list[int]) -> bool:
    return bool(kvcr_pages.restore(linker, rid, hashes, pages))


def local_round_trip(
    linker: Any, pool: Any, tag: str, src: int, dst: int, *, seed: int
) -> tuple[bool, bool]:
    """Fill page ``src``, offload it, restore it into ``dst``: (stored, exact)."""
    kvcr_pages.fill_random(pool, [src], seed=seed)
    hashes = hashes_for(1, tag)
    stored = offload_and_commit(linker, hashes, [src])
    prepare(linker, tag, hashes)
    exact = restore(linker, tag, hashes, [dst]) and page_data(pool, dst) == page_data(
        pool, src
    )
    linker.finish_request(tag)
    return stored, exact


def kvcr_claims(linker: Any) -> int:
    """Release handles KVCR itself still counts as held."""
    return int(linker.claims_outstanding())


def settle(linker: Any) -> tuple[int, int]:
    """Let in-flight KVCR work finish and late claims be released; returns
    (claims the linker holds, claims KVCR holds)."""
    linker._adapter.wait_idle(WAIT_S)
    linker._pump()  # may submit releases of late claims; call() runs after them
    linker._adapter.wait_idle(WAIT_S)
    linker._pump()
    return linker.claims_held(), kvcr_claims(linker)


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


def unresolved_operations(linker: Any) -> int:
    """Operations ``linker``'s KVCR still owns (asked on its owner thread)."""
    from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_patches

    return int(linker._adapter.call(kvcr_patches.unresolved_operations))


def retained_count() -> int:
    from sglang.srt.mem_cache.storage.kvcr.owner import quarantine

    return len(quarantine._RETAINED)


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
        pool = kvcr_pages.make_pool()
        lk = make_linker(pool, **{**BASE_CONFIG, **overrides})
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
        make_linker(kvcr_pages.make_pool(), **BASE_CONFIG).close()
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
