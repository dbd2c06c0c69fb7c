"""Prometheus metrics of the KVCR linker, published from its one stats snapshot.

With ``--enable-metrics`` SGLang runs prometheus_client in multiprocess mode (its
launcher sets ``PROMETHEUS_MULTIPROC_DIR`` before the scheduler starts) and its
HTTP server exports every process's samples on ``/metrics``. ``build`` then
registers the ``sglang:kvcr_*`` families once per process, here the scheduler's,
labelled like SGLang's scheduler metrics (metric_labels) plus one
bounded label of our own per family (a cause, a reason, a budget: never a
request, key or endpoint). ``LinkerMetrics.tick`` publishes at most once per
``PUBLISH_PERIOD_S`` from ``linker_stats.snapshot``, the numbers the
``KVCR_STATS`` line prints: counters by the snapshot's increase since the last
publish (a source that restarted from zero, the adapter after a flush, counts
from zero), gauges to its values, histograms by the durations the stats object
recorded since (``Samples``, drained). Without the flag ``build`` returns
``NO_METRICS``: prometheus_client is not imported, nothing is registered, and
``tick`` does nothing. ``FAMILIES`` is the one list the docs' reference mirrors.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import weakref
from collections.abc import Callable
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.fleet.router_hint import HintRejection
from sglang.srt.mem_cache.storage.kvcr.observability.linker_stats import Sample, Samples

logger = logging.getLogger(__name__)

PREFIX = "sglang:kvcr_"
PUBLISH_PERIOD_S = 1.0
# Seconds: a restore copy takes microseconds to milliseconds, a preparation or an
# admission wait up to its preparation_timeout_ms.
BUCKETS_S = (
    0.0001,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class Kind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclasses.dataclass(frozen=True, slots=True)
class Series:
    """One labelled series of a family and where its value is in the snapshot."""

    path: tuple[str, ...]  # keys into the snapshot (nested for misses, hints)
    value: str = ""  # the family's own label value ("" when it has none)
    per_token: bool = False  # a page count exported in tokens (x page size)


@dataclasses.dataclass(frozen=True, slots=True)
class Family:
    """One metric family: its exported name, what it means and its series."""

    name: str  # exported name (counters end in _total)
    kind: Kind
    doc: str
    label: str = ""  # the family's own label name, if any
    series: tuple[Series, ...] = ()  # counters and gauges
    sample: Sample | None = None  # histograms


def _one(kind: Kind, name: str, doc: str, *path: str, tokens: bool = False) -> Family:
    return Family(PREFIX + name, kind, doc, series=(Series(path, per_token=tokens),))


def _by(
    kind: Kind, name: str, doc: str, label: str, paths: dict[str, tuple[str, ...]]
) -> Family:
    series = tuple(Series(path, value) for value, path in paths.items())
    return Family(PREFIX + name, kind, doc, label, series)


_C, _G = Kind.COUNTER, Kind.GAUGE

FAMILIES: tuple[Family, ...] = (
    _one(_C, "lookups_total", "Lookups the tree made.", "lookups"),
    _one(_C, "hit_pages_total", "Pages lookups reported restorable.", "hit_pages"),
    _one(
        _C,
        "hit_tokens_total",
        "Tokens lookups reported restorable (hit pages x page size).",
        "hit_pages",
        tokens=True,
    ),
    _one(_C, "loads_total", "Restores queued.", "loads"),
    _one(
        _C,
        "restored_bytes_total",
        "Bytes copied from KVCR DRAM into device KV by restores that landed.",
        "restored_bytes",
    ),
    _one(
        _C,
        "load_failures_total",
        "Restores that had to fail (claims missing: that request is aborted).",
        "load_failures",
    ),
    _one(
        _C,
        "restore_copy_failures_total",
        "Restore batches whose copy raised (restores pause).",
        "restore_copy_failures",
    ),
    _one(_C, "offloaded_pages_total", "Pages offloads submitted.", "offload_pages"),
    _one(
        _C,
        "offloaded_bytes_total",
        "Bytes write-through offloads stored in KVCR DRAM.",
        "offloaded_bytes",
    ),
    _one(
        _C,
        "offload_failures_total",
        "Offloads that completed as failed.",
        "offload_failures",
    ),
    _by(
        _C,
        "misses_total",
        "Lookups that found nothing restorable, by cause.",
        "cause",
        {
            "prefix_moved": ("misses", "prefix_moved"),
            "unclaimed": ("misses", "unclaimed"),
            "restore_disabled": ("misses", "restore_disabled"),
            "unprepared": ("misses", "unprepared"),
            "kvcr_down": ("misses", "kvcr_down"),
            "weights_changed": ("weights_changed_misses",),
        },
    ),
    _one(
        _C,
        "prepare_deadline_expired_total",
        "Preparations admitted at their deadline with what had landed.",
        "deadline_expired",
    ),
    _one(
        _C,
        "hints_accepted_total",
        "kv.fetch hints the parser accepted.",
        "hints",
        "accepted",
    ),
    _by(
        _C,
        "hints_rejected_total",
        "kv.fetch hints the parser rejected, by reason.",
        "reason",
        {r.value: ("hints", f"rejected_{r.value}") for r in HintRejection},
    ),
    _one(
        _C,
        "hints_self_total",
        "Accepted hints naming this worker (served from local residency).",
        "hints_self",
    ),
    _by(
        _C,
        "hints_ignored_total",
        "Accepted hints not fetched, by reason.",
        "reason",
        {
            "peer_fetches_off": ("hints_quarantine_off",),
            "multi_node": ("hints_multinode_off",),
        },
    ),
    _one(
        _C, "evicted_pages_total", "Pages KVCR evicted for capacity.", "evicted_pages"
    ),
    _by(
        _C,
        "backpressure_refusals_total",
        "Operations refused by a bound, by what was full.",
        "cause",
        {
            "offload_budget": ("refused_offload",),
            "prepare_budget": ("refused_prepare",),
            "offload_staging": ("staging_full",),
            "abandoned_bytes": ("refused_abandoned",),
        },
    ),
    _one(
        _C,
        "inbound_refused_total",
        "Control connections this worker refused.",
        "inbound_refused",
    ),
    _one(
        _C,
        "failures_total",
        "Times this rank's KVCR failed (the linker went down).",
        "kvcr_failures",
    ),
    _one(
        _C,
        "restarts_total",
        "Restarts that brought this rank's KVCR back.",
        "kvcr_restarts",
    ),
    _one(_G, "resident_keys", "KVCR objects resident here.", "resident_keys"),
    _one(_G, "claims_held", "Residency claims this rank holds.", "claims_held"),
    _one(
        _G,
        "dram_used_bytes",
        "Bytes of the objects resident in KVCR DRAM.",
        "dram_used_bytes",
    ),
    _one(_G, "dram_bytes", "This rank's KVCR DRAM share.", "dram_bytes"),
    _one(_G, "pinned_bytes", "Host bytes page-locked for KVCR.", "pinned_bytes"),
    _one(
        _G,
        "quarantined_bytes",
        "KVCR DRAM bytes quarantined after unclean flushes.",
        "quarantined_bytes",
    ),
    _one(
        _G,
        "abandoned_bytes",
        "Fetch bytes still owed to requests that went away.",
        "abandoned_bytes",
    ),
    _by(
        _G,
        "inflight_bytes",
        "Bytes in flight against a budget.",
        "op",
        {
            "offload": ("inflight_offload_bytes",),
            "prepare": ("inflight_prepare_bytes",),
        },
    ),
    _one(
        _G,
        "down",
        "1 while this rank's KVCR is down (every request recomputed).",
        "kvcr_down",
    ),
    _one(
        _G,
        "peer_fetches_off",
        "1 while peer fetches are off (quarantine bound reached).",
        "peer_fetches_off",
    ),
    Family(
        PREFIX + "prepare_wait_seconds",
        Kind.HISTOGRAM,
        "From a preparation's start until its pages landed (or its deadline).",
        sample=Sample.PREPARE_WAIT,
    ),
    Family(
        PREFIX + "admission_wait_seconds",
        Kind.HISTOGRAM,
        "Readiness-gate hold of a request, from its first held pass to release.",
        sample=Sample.ADMISSION_WAIT,
    ),
    Family(
        PREFIX + "restore_copy_seconds",
        Kind.HISTOGRAM,
        "Restore copy time of each request (its batch's copy).",
        sample=Sample.RESTORE_COPY,
    ),
)


class NoMetrics:
    """Metrics off: nothing is imported, registered or published."""

    __slots__ = ()

    def tick(self, now: float, force: bool = False) -> None:
        pass


NO_METRICS = NoMetrics()

# Per registry (the process's default one in a server): family name -> metric,
# created once; a second linker of the process reuses them.
_REGISTERED: weakref.WeakKeyDictionary[Any, tuple[tuple[str, ...], dict[str, Any]]]
_REGISTERED = weakref.WeakKeyDictionary()


def _families(registry: Any, label_names: tuple[str, ...]) -> dict[str, Any]:
    from prometheus_client import Counter, Gauge, Histogram

    known = _REGISTERED.get(registry)
    if known is not None:
        if known[0] != label_names:
            raise ValueError(
                f"KVCR metrics are registered with labels {known[0]}, not "
                f"{label_names}: one label set per process"
            )
        return known[1]
    made: dict[str, Any] = {}
    for f in FAMILIES:
        names = [*label_names, f.label] if f.label else list(label_names)
        common = {"labelnames": names, "registry": registry}
        if f.kind is Kind.COUNTER:
            made[f.name] = Counter(f.name, f.doc, **common)
        elif f.kind is Kind.GAUGE:
            made[f.name] = Gauge(
                f.name, f.doc, multiprocess_mode="mostrecent", **common
            )
        else:
            made[f.name] = Histogram(f.name, f.doc, buckets=BUCKETS_S, **common)
    _REGISTERED[registry] = (label_names, made)
    return made


def _read(snapshot: dict[str, Any], path: tuple[str, ...]) -> float:
    value: Any = snapshot
    for key in path:
        value = value[key]
    return float(value)


class LinkerMetrics:
    """The ``sglang:kvcr_*`` series of one linker (see the module docstring)."""

    def __init__(
        self,
        labels: dict[str, str],
        page_size: int,
        snapshot: Callable[[], dict[str, Any]],
        samples: Samples,
        registry: Any = None,
        period_s: float = PUBLISH_PERIOD_S,
    ) -> None:
        if registry is None:
            import prometheus_client

            registry = prometheus_client.REGISTRY
        made = _families(registry, tuple(labels))
        self._snapshot = snapshot
        self._samples = samples
        self._period_s = period_s
        self._page_size = page_size
        self._next = 0.0
        self._failed = False
        self._series: list[tuple[Kind, Series, Any]] = []  # with its child
        self._histograms: list[tuple[Sample, Any]] = []
        for f in FAMILIES:
            metric = made[f.name]
            if f.sample is not None:
                self._histograms.append((f.sample, metric.labels(**labels)))
                continue
            for s in f.series:
                own = {f.label: s.value} if f.label else {}
                self._series.append((f.kind, s, metric.labels(**labels, **own)))
        self._last = [0.0] * len(self._series)  # what each counter published
        samples.kept = True

    def tick(self, now: float, force: bool = False) -> None:
        """Publish if ``period_s`` passed since the last publish (or ``force``)."""
        if not force and now < self._next:
            return
        self._next = now + self._period_s
        try:
            self.publish(self._snapshot())
        except Exception:
            if not self._failed:  # once: a broken exporter must not stop serving
                logger.exception("KVCR metrics could not be published")
            self._failed = True

    def publish(self, snapshot: dict[str, Any]) -> None:
        """Move every series to ``snapshot`` and observe the recorded durations."""
        for i, (kind, series, child) in enumerate(self._series):
            value = _read(snapshot, series.path)
            if series.per_token:
                value *= self._page_size
            if kind is Kind.GAUGE:
                child.set(value)
                continue
            last = self._last[i]
            delta = value - last if value >= last else value  # restarted from 0
            if delta:
                child.inc(delta)
            self._last[i] = value
        for sample, child in self._histograms:
            for seconds in self._samples.drain(sample):
                child.observe(seconds)


def build(
    server_args: Any,
    page_size: int,
    samples: Samples,
    snapshot: Callable[[], dict[str, Any]],
) -> LinkerMetrics | NoMetrics:
    """The linker's metrics: ``NO_METRICS`` unless ``--enable-metrics``."""
    if not getattr(server_args, "enable_metrics", False):
        return NO_METRICS

    return LinkerMetrics(metric_labels(), page_size, snapshot, samples)


def exported_names() -> dict[str, tuple[str, str]]:
    """``{exported name: (kind, own label)}`` of every family (the docs list)."""
    return {f.name: (f.kind.value, f.label) for f in FAMILIES}


def metric_labels() -> dict[str, str]:
    """The labels SGLang 0.5.23's scheduler metrics carry in this process
    (``SchedulerMetricsCollector.init_new``): served model, engine type, TP/PP/EP
    ranks, the DP rank when there is one, and ``--extra-metric-labels``."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import (
        get_disagg,
        get_observability,
        get_parallel,
        get_serving,
    )

    disagg, parallel = get_disagg(), get_parallel()
    engine_type = (
        "dynamic"
        if disagg.enable_pd_role_switch
        else DisaggregationMode.to_engine_type(disagg.disaggregation_mode)
    )
    labels = {
        "model_name": get_serving().served_model_name,
        "engine_type": engine_type,
        "tp_rank": parallel.tp_rank,
        "pp_rank": parallel.pp_rank,
        "moe_ep_rank": parallel.moe_ep_rank,
    }
    if parallel.dp_rank is not None:
        labels["dp_rank"] = parallel.dp_rank
    labels.update(get_observability().extra_metric_labels or {})
    return {name: str(value) for name, value in labels.items()}
