"""The microbench's targets, its metric record, and how it reads the machine.

``TARGETS`` are the issue's thresholds per metric (None: informational);
``metric`` builds the record the report's ``metrics`` list holds and the docs'
figures table names; ``pct`` / ``dist`` summarize a list of samples (every
section's and the decode ITL's); ``paired_ci`` bounds a paired statistic of them
(``ratio_ci``: their ratio of medians; with ``median_difference``, a median
paired difference).
``busy_fraction`` / ``wait_for_quiet`` / ``thread_cpu_pct`` read /proc
(``machine_cpu_ticks``, ``proc_stat``) so a section can wait for a quiet machine
and say what it saw.
"""

from __future__ import annotations

import gc
import math
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Target:
    field: str  # "value" or "ratio"
    op: str
    bound: float

    def text(self) -> str:
        return f"{self.field} {self.op} {self.bound:g}"

    def check(self, metric: dict[str, Any]) -> bool:
        got = metric.get(self.field)
        if got is None or (isinstance(got, float) and math.isnan(got)):
            return False
        return {
            "<=": got <= self.bound,
            ">=": got >= self.bound,
            "==": got == self.bound,
        }[self.op]


TRANSFER_PAGES = (47, 256)  # a 3000-token prompt at page 64, and a long context

# The CPU targets (ratios measured side by side in this run).
TARGETS: dict[str, Target | None] = {
    "zero_hit_ttft_ratio": Target("ratio", "<=", 1.02),  # issue 23 (was 1.05)
    "restore_copy_vs_torch_copy": Target("ratio", ">=", 0.9),  # issue 23 (was 0.8)
    "offload_vs_nixl_loopback": Target("ratio", ">=", 0.7),
    # Informational: no linker's median TTFT plus what kvcr adds outside the
    # forward (zero_hit_stages), a measurement by parts beside the target above.
    "zero_hit_ttft_ratio_outside_forward": None,
    "zero_hit_prepare_us_p50": Target("value", "<=", 100.0),
    "zero_hit_owner_commands": Target("value", "==", 0),
    # Issue 23: a local hit prepared within 1 ms (47 pages), back to back: each
    # also pays the release of the previous one's claims on the owner thread.
    "hit_prepare_us_p50": Target("value", "<=", 1000.0),
    "hit_not_ready_at_once": Target("value", "==", 0),  # issue 23: 0 extra passes
    "hint_prepare_us_p50": None,  # informational: bound by the peer transfer
    "hook_overhead_us_p50": Target("value", "<=", 150.0),
    "linker_idle_cpu_pct": None,  # informational: background cost of an idle linker
    # Foreground decode ITL under write-through load, kvcr over none (serving).
    "decode_itl_p50_ratio": None,
    "decode_itl_p99_ratio": Target("ratio", "<=", 1.1),
    # Issue 23 (serving): an evicted prompt replayed from KVCR against a device
    # radix hit of it, and against recomputing it (on the server without KVCR).
    "replay_ttft_vs_device_hit": Target("ratio", "<=", 1.05),
    "replay_ttft_vs_recompute": None,
    # The write-through of that traffic: pages offloaded per second (informational)
    # and offloads refused or failed (none).
    "write_through_pages_per_s": None,
    "write_through_refusals": Target("value", "==", 0),
    # Informational: how much more a kvcr server's cold prefills slow down back
    # to back (each served while the one before is written through) than none's.
    "write_through_back_to_back": None,
    # Informational: the offload against the same plain copy run on a side thread
    # whose end is polled at the offload's pace (what the bench's poll costs).
    **{f"offload_vs_polled_d2h_{n}p": None for n in TRANSFER_PAGES},
    # The CUDA targets (issue 11); on cpu CPU_TRANSFER_TARGETS apply instead.
    **{
        f"restore_vs_pinned_h2d_{n}p": Target("ratio", ">=", 0.8)
        for n in TRANSFER_PAGES
    },
    **{
        f"offload_vs_pinned_d2h_{n}p": Target("ratio", ">=", 0.7)
        for n in TRANSFER_PAGES
    },
}


# Issue 23's CPU targets for the transfer section: the one-copy offload against a
# plain host copy of the same bytes, the restore against a plain copy into the pool.
CPU_TRANSFER_TARGETS: dict[str, Target] = {
    **{
        f"restore_vs_pinned_h2d_{n}p": Target("ratio", ">=", 0.9)
        for n in TRANSFER_PAGES
    },
    **{
        f"offload_vs_pinned_d2h_{n}p": Target("ratio", ">=", 0.8)
        for n in TRANSFER_PAGES
    },
}


def target_of(name: str, device: str) -> Target | None:
    """The target a metric of a ``device`` run is held to (None: informational)."""
    if device != "cuda" and name.startswith(("restore_vs_pinned", "offload_vs_pinned")):
        return CPU_TRANSFER_TARGETS.get(name)
    return TARGETS.get(name)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def dist(values: list[float], digits: int = 3) -> dict[str, Any]:
    """Count, p50/p90/p99, min and max of ``values``, rounded to ``digits``."""
    return {
        "n": len(values),
        "p50": round(statistics.median(values), digits),
        "p90": round(pct(values, 0.9), digits),
        "p99": round(pct(values, 0.99), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def bootstrap_paired(
    a: list[Any],
    b: list[Any],
    statistic: Callable[[list[Any], list[Any]], float],
    reps: int = 2000,
    seed: int = 0,
) -> list[float]:
    """``statistic(a', b')`` over ``reps`` paired resamples (round ``i`` of ``a``
    with round ``i`` of ``b``, drawn together), sorted."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError("a paired bootstrap needs two lists of at least 2 samples")
    rng = random.Random(seed)
    n = len(a)
    values = []
    for _ in range(reps):
        pick = [rng.randrange(n) for _ in range(n)]
        values.append(statistic([a[i] for i in pick], [b[i] for i in pick]))
    return sorted(values)


def ratio_of_medians(a: list[float], b: list[float]) -> float:
    return statistics.median(a) / statistics.median(b)


def median_difference(a: list[float], b: list[float]) -> float:
    """The median of the paired differences ``a[i] - b[i]``."""
    return statistics.median([x - y for x, y in zip(a, b, strict=True)])


def bootstrap_ratios(
    a: list[float], b: list[float], reps: int = 2000, seed: int = 0
) -> list[float]:
    """median(a) / median(b) over ``reps`` paired resamples, sorted."""
    return bootstrap_paired(a, b, ratio_of_medians, reps, seed)


def paired_ci(
    a: list[Any],
    b: list[Any],
    statistic: Callable[[list[Any], list[Any]], float] = ratio_of_medians,
    level: float = 0.9,
    reps: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """Bootstrap ``level`` interval of ``statistic`` over paired samples
    (``bootstrap_paired``): how far it moves with the rounds a run happened to
    draw. A target bound inside the interval is one this run cannot tell apart."""
    if not 0.0 < level < 1.0 or reps < 1:
        raise ValueError(
            f"a bootstrap interval needs 0 < level < 1 and reps >= 1, not {level}, {reps}"
        )
    values = bootstrap_paired(a, b, statistic, reps, seed)
    # As many resamples left out on each side, low end never past the high.
    k = min((reps - 1) // 2, round((1.0 - level) / 2 * reps))
    return values[k], values[reps - 1 - k]


def ratio_ci(
    a: list[float],
    b: list[float],
    level: float = 0.9,
    reps: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """``paired_ci`` of median(a) / median(b)."""
    return paired_ci(a, b, ratio_of_medians, level, reps, seed)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def machine_cpu_ticks() -> list[int]:
    """Every CPU's summed time by state (the ``cpu`` line of /proc/stat): user,
    nice, system, idle, iowait, ... in clock ticks."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def proc_stat(path: str) -> list[str] | None:
    """The fields of a process's or thread's /proc ``stat`` file after its name
    (``[2]`` is its process group), or None when it is gone."""
    try:
        with open(path) as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def cpu_ticks(fields: list[str]) -> int:
    """User + system clock ticks of a ``proc_stat`` row."""
    return int(fields[11]) + int(fields[12])


def busy_fraction(interval_s: float = 1.0) -> float:
    """Share of all CPUs' time not idle over ``interval_s`` (from /proc/stat)."""

    def sample() -> tuple[int, int]:
        fields = machine_cpu_ticks()
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    total0, idle0 = sample()
    time.sleep(interval_s)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_for_quiet(limit: float, timeout_s: float) -> dict[str, Any]:
    """Wait (bounded) until the machine is mostly idle; say what was seen."""
    deadline = time.monotonic() + timeout_s
    seen = busy_fraction()
    waited = 0.0
    while seen > limit and time.monotonic() < deadline:
        waited += 1.0
        seen = busy_fraction()
    return {"busy": round(seen, 3), "quiet": seen <= limit, "waited_s": waited}


def thread_cpu_pct(seconds: float) -> dict[str, float]:
    """CPU each thread of this process used over ``seconds``, in % of one core."""
    import threading

    def ticks() -> dict[int, int]:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            fields = proc_stat(f"/proc/self/task/{tid}/stat")
            if fields is not None:
                out[int(tid)] = cpu_ticks(fields)
        return out

    hz = os.sysconf("SC_CLK_TCK")
    before = ticks()
    time.sleep(seconds)
    after = ticks()
    names = {t.native_id: t.name for t in threading.enumerate()}
    used: dict[str, float] = {}
    for tid, n in after.items():
        name = names.get(tid, "native")
        pct_core = 100.0 * (n - before.get(tid, n)) / hz / seconds
        used[name] = round(used.get(name, 0.0) + pct_core, 1)
    return {k: v for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v}


def settle() -> None:
    """Collect, then freeze survivors so GC pauses stay out of the samples."""
    gc.collect()
    gc.freeze()


def random_hashes(rng: random.Random, n: int) -> list[str]:
    return [f"{rng.getrandbits(256):064x}" for _ in range(n)]


def metric(
    name: str,
    value: float | None,
    unit: str,
    baseline: float | None = None,
    *,
    ratio: float | None = None,
    error: str | None = None,
    informational: bool = False,
    target: Target | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """``target`` replaces ``TARGETS[name]`` (a device's own threshold)."""
    if ratio is None and value is not None and baseline:
        ratio = value / baseline
    if target is None:
        target = TARGETS.get(name)
    if informational:
        target = None
    m: dict[str, Any] = {
        "name": name,
        "value": None if value is None else round(value, 4),
        "unit": unit,
        "baseline": None if baseline is None else round(baseline, 4),
        "ratio": None if ratio is None else round(ratio, 4),
        "target": None if target is None else target.text(),
    }
    m["passed"] = None if target is None else (error is None and target.check(m))
    if error:
        m["error"] = error
    m.update(extra)
    return m
