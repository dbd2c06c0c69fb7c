"""The linker's counters, and the one snapshot both the stats line and drivers read.

``LinkerStats`` holds what the linker counts as it works. ``Gauges`` are the
values each collaborator reads off its own live state when a snapshot is taken
(``DramGauges``: bytes quarantined and pinned; ``ResidencyGauges``: keys
resident; ``PreparationGauges``: claims held, ...). ``snapshot`` merges both with the adapter's budget
counters and the hint parser's, as one flat dict keyed by the names the
``KVCR_STATS`` line prints (``misses`` and ``hints`` are nested dicts), and
``stats_line`` formats exactly that dict, so the log line, the drivers that parse
it and any exporter see the same numbers under the same names. ``Samples``
keeps the durations behind the wait and copy figures, one by one, for the
Prometheus histograms (linker_metrics): nothing is kept until an exporter turns
it on, and at most ``SAMPLES_KEPT`` of each kind wait for it to drain them.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

SAMPLES_KEPT = 4096  # per kind, between two drains (the oldest are dropped)


class Sample(enum.Enum):
    """What a recorded duration measured."""

    PREPARE_WAIT = "prepare_wait"  # a preparation's start until its pages landed
    ADMISSION_WAIT = "admission_wait"  # first readiness-gate hold until release
    RESTORE_COPY = "restore_copy"  # one request's restore batch copy


@dataclasses.dataclass(slots=True)
class Samples:
    """Durations in seconds since the exporter last drained them. Appends and
    drains may run on different threads (restore copies run on the loader)."""

    kept: bool = False  # set by an exporter; off, ``add`` keeps nothing
    values: dict[Sample, collections.deque[float]] = dataclasses.field(
        default_factory=lambda: {
            kind: collections.deque(maxlen=SAMPLES_KEPT) for kind in Sample
        }
    )

    def add(self, kind: Sample, seconds: float) -> None:
        if self.kept:
            self.values[kind].append(seconds)

    def drain(self, kind: Sample) -> list[float]:
        """The durations of ``kind`` recorded since the last drain, oldest first."""
        queue, out = self.values[kind], []
        while queue:
            out.append(queue.popleft())
        return out


@dataclasses.dataclass(slots=True)
class LinkerStats:
    lookups: int = 0
    lookup_fast_miss: int = 0
    hit_pages: int = 0
    loads: int = 0
    load_pages: int = 0
    load_failures: int = 0
    offloads: int = 0
    offload_pages: int = 0
    offload_failures: int = 0
    prepared: int = 0
    prepared_pages: int = 0
    prepare_deadline_expired: int = 0
    late_claims_released: int = 0
    miss_prefix_moved: int = 0
    miss_unclaimed: int = 0
    miss_restore_disabled: int = 0
    miss_unprepared: int = 0
    miss_kvcr_down: int = 0  # lookups while KVCR was down (recovery)
    restore_copy_failures: int = 0
    hints_self: int = 0  # hints naming this worker: served from local residency
    hints_quarantine_off: int = 0  # hints ignored: peer fetches off (quarantine)
    hints_multinode_off: int = 0  # hints ignored: attention ranks span nodes
    # hints ignored: failed peer fetches hold over max_abandoned_bytes of DRAM
    hints_unresolved_off: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0
    prepare_ms_total: float = 0.0
    prepare_ms_max: float = 0.0
    prepare_done: int = 0
    # Readiness gate: requests it held back at least once and then let through,
    # the passes they were held for, and the wait from first hold to release.
    admission_held: int = 0
    admission_held_passes: int = 0
    admission_wait_ms_total: float = 0.0
    admission_wait_ms_max: float = 0.0
    offload_staging_full: int = 0
    refused_abandoned: int = 0
    refused_claimed: int = 0  # preparations refused: claims over max_claimed_bytes
    # Local-only preparations whose claims took longer than local_hit_wait_ms
    # (admitted a pass later).
    local_hit_waits_expired: int = 0
    # Enqueued attempts without a hint whose tail's first page is not resident
    # here (per rank): not prepared, only that page hashed at enqueue.
    prepare_skipped: int = 0
    # Idle scheduler passes that blocked for an offload in flight
    # (idle_offload_wait_us), and the time they blocked.
    idle_offload_waits: int = 0
    idle_offload_wait_ms_total: float = 0.0
    evicted_pages: int = 0
    # Idle passes that collected and froze the heap (owner.idle_freeze), the
    # garbage their collections found and the time they took.
    gc_freezes: int = 0
    gc_collected: int = 0
    gc_freeze_ms_total: float = 0.0
    gc_freeze_ms_max: float = 0.0
    refused_weights_changed: int = 0  # lookups between a weight update and flush
    samples: Samples = dataclasses.field(default_factory=Samples)


@dataclasses.dataclass(frozen=True, slots=True)
class DramGauges:
    """The rank's KVCR DRAM share as ``quarantine.KVCRDram`` reports it."""

    peer_fetches_off: bool = False
    quarantined_bytes: int = 0
    pinned_bytes: int = 0
    dram_bytes: int = 0  # this rank's KVCR DRAM share, as allocated


@dataclasses.dataclass(frozen=True, slots=True)
class ResidencyGauges:
    """What KVCR holds, as ``residency.Residency`` mirrors it."""

    resident_keys: int = 0
    dram_used_bytes: int = 0  # bytes of the objects resident in KVCR DRAM


@dataclasses.dataclass(frozen=True, slots=True)
class PreparationGauges:
    """What ``preparation.Preparations`` holds for the requests."""

    claims_held: int = 0
    abandoned_bytes: int = 0  # still fetched for preparations that were dropped
    claimed_bytes: int = 0  # claimed or being fetched for live preparations


@dataclasses.dataclass(frozen=True, slots=True)
class KVCRGauges:
    """Whether this rank's KVCR is up, as ``owner.recovery.Recovery`` says."""

    failures: int = 0  # times it went down
    restarts: int = 0  # restarts that brought it back
    down: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Gauges:
    """Values read off the collaborators' live state for one snapshot, each part
    from the collaborator that owns it."""

    dram: DramGauges
    residency: ResidencyGauges
    preparations: PreparationGauges
    inbound_refused: int  # control connections the inbound guard refused
    kvcr: KVCRGauges = KVCRGauges()


def snapshot(
    s: LinkerStats, gauges: Gauges, adapter: Any, hints: dict[str, int]
) -> dict[str, Any]:
    """Every number of the stats line, by its name in the line, in its order."""
    d, r, p = gauges.dram, gauges.residency, gauges.preparations
    return {
        "lookups": s.lookups,
        "fast_miss": s.lookup_fast_miss,
        "hit_pages": s.hit_pages,
        "loads": s.loads,
        "load_pages": s.load_pages,
        "load_failures": s.load_failures,
        "offloads": s.offloads,
        "offload_pages": s.offload_pages,
        "offload_failures": s.offload_failures,
        "staging_full": s.offload_staging_full,
        "misses": {
            "prefix_moved": s.miss_prefix_moved,
            "unclaimed": s.miss_unclaimed,
            "restore_disabled": s.miss_restore_disabled,
            "unprepared": s.miss_unprepared,
            "kvcr_down": s.miss_kvcr_down,
        },
        "restore_copy_failures": s.restore_copy_failures,
        "hints_self": s.hints_self,
        "hints_quarantine_off": s.hints_quarantine_off,
        "hints_multinode_off": s.hints_multinode_off,
        "hints_unresolved_off": s.hints_unresolved_off,
        "peer_fetches_off": int(d.peer_fetches_off),
        "weights_changed_misses": s.refused_weights_changed,
        "offloaded_bytes": s.offloaded_bytes,
        "restored_bytes": s.restored_bytes,
        "prepare_wait_ms_avg": round(s.prepare_ms_total / max(1, s.prepare_done), 2),
        "prepare_wait_ms_max": round(s.prepare_ms_max, 2),
        "admission_wait_ms_avg": round(
            s.admission_wait_ms_total / max(1, s.admission_held), 2
        ),
        "admission_wait_ms_max": round(s.admission_wait_ms_max, 2),
        "admission_held": s.admission_held,
        "admission_held_passes": s.admission_held_passes,
        "quarantined_bytes": d.quarantined_bytes,
        "pinned_bytes": d.pinned_bytes,
        "prepared": s.prepared,
        "prepared_pages": s.prepared_pages,
        "deadline_expired": s.prepare_deadline_expired,
        "evicted_pages": s.evicted_pages,
        "abandoned_bytes": p.abandoned_bytes,
        "refused_abandoned": s.refused_abandoned,
        "unresolved_fill_bytes": adapter.unresolved_fill_bytes,
        "resident_keys": r.resident_keys,
        "dram_used_bytes": r.dram_used_bytes,
        "dram_bytes": d.dram_bytes,
        "claims_held": p.claims_held,
        "claimed_bytes": p.claimed_bytes,
        "refused_claimed": s.refused_claimed,
        "local_hit_waits_expired": s.local_hit_waits_expired,
        "prepare_skipped": s.prepare_skipped,
        "idle_offload_waits": s.idle_offload_waits,
        "idle_offload_wait_ms_total": round(s.idle_offload_wait_ms_total, 3),
        "gc_freezes": s.gc_freezes,
        "gc_collected": s.gc_collected,
        "gc_freeze_ms_total": round(s.gc_freeze_ms_total, 3),
        "gc_freeze_ms_max": round(s.gc_freeze_ms_max, 3),
        "refused_offload": adapter.refused_offload,
        "refused_prepare": adapter.refused_prepare,
        "inflight_offload_bytes": adapter.inflight_offload_bytes,
        "inflight_prepare_bytes": adapter.inflight_prepare_bytes,
        "inbound_refused": gauges.inbound_refused,
        "dropped_notices": adapter.dropped_notices,
        "kvcr_failures": gauges.kvcr.failures,
        "kvcr_restarts": gauges.kvcr.restarts,
        "kvcr_down": int(gauges.kvcr.down),
        "hints": dict(hints),
    }


_FLOATS = frozenset(
    {
        "prepare_wait_ms_avg",
        "prepare_wait_ms_max",
        "admission_wait_ms_avg",
        "admission_wait_ms_max",
    }
)


def stats_line(values: dict[str, Any]) -> str:
    """The ``KVCR_STATS`` log line of a snapshot."""
    parts = []
    for name, value in values.items():
        if name == "misses":
            inner = ", ".join(f"{k}: {v}" for k, v in value.items())
            parts.append(f"misses={{{inner}}}")
        elif name in _FLOATS:
            parts.append(f"{name}={value:.2f}")
        else:
            parts.append(f"{name}={value}")
    return "KVCR_STATS " + " ".join(parts)


class StatsReport:
    """Where one linker's snapshot goes: the ``KVCR_STATS`` log line every
    ``period_s`` (or when forced) and its Prometheus series (linker_metrics),
    which publish on their own cadence from the same snapshot."""

    __slots__ = ("_last", "_period_s", "_snapshot", "metrics")

    def __init__(
        self,
        snapshot: Callable[[], dict[str, Any]],
        metrics: Any,
        period_s: float = 30.0,
    ) -> None:
        self._snapshot = snapshot
        self.metrics = metrics  # linker_metrics.LinkerMetrics or NO_METRICS
        self._period_s = period_s
        self._last = time.monotonic()

    def line(self) -> str:
        return stats_line(self._snapshot())

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        self.metrics.tick(now, force)
        if force or now - self._last >= self._period_s:
            self._last = now
            logger.info("%s", self.line())
