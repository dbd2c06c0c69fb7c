"""The linker's Prometheus metrics come from its one stats snapshot.

Over a real offload and restore through a bare linker, each ``sglang:kvcr_*``
series moves by what the snapshot moved (restored bytes are the pages times the
layout's page bytes, hit tokens the hit pages times the page size), a publish
with nothing new moves nothing, and a source that restarted from zero (the
adapter after a flush) counts from zero. The registered families are exactly
``FAMILIES`` and exactly the docs' metrics reference. Without
``--enable-metrics`` nothing is imported or registered.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
from prometheus_client import CollectorRegistry

from cpu_harness.kvcr_pages import (
    PAGE,
    PAGE_BYTES,
    fill_random,
    hashes_for,
    offload_and_commit,
    prepare,
    restore,
)
from cpu_harness.server import REPO, server_env
from sglang.srt.mem_cache.storage.kvcr.fleet.router_hint import HintStats
from sglang.srt.mem_cache.storage.kvcr.observability import linker_metrics, linker_stats
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import AdapterStats

pytestmark = pytest.mark.kvcr

LABELS = {"model_name": "tiny-test", "tp_rank": "0"}


def _value(registry, name, **own):
    value = registry.get_sample_value(name, {**LABELS, **own})
    assert value is not None, f"{name} {own} not exported"
    return value


def test_each_series_moves_by_what_the_snapshot_moved(pool, linker):
    registry = CollectorRegistry()
    metrics = linker_metrics.LinkerMetrics(
        LABELS, linker.page_size, linker.stats_snapshot, linker.stats.samples, registry
    )
    metrics.tick(0.0)
    assert _value(registry, "sglang:kvcr_restored_bytes_total") == 0
    fill_random(pool, [1, 2, 3], seed=5)
    hashes = hashes_for(3, "metrics")
    assert offload_and_commit(linker, hashes, [1, 2, 3]) is True
    prepare(linker, "r", hashes[:2])
    assert restore(linker, "r", hashes[:2], [7, 8])
    metrics.tick(0.5)  # inside the period: nothing published yet
    assert _value(registry, "sglang:kvcr_restored_bytes_total") == 0
    metrics.tick(1.0)
    snap = linker.stats_snapshot()
    assert _value(registry, "sglang:kvcr_restored_bytes_total") == 2 * PAGE_BYTES
    assert _value(registry, "sglang:kvcr_offloaded_bytes_total") == 3 * PAGE_BYTES
    assert _value(registry, "sglang:kvcr_offloaded_pages_total") == 3
    assert _value(registry, "sglang:kvcr_hit_pages_total") == 2
    assert _value(registry, "sglang:kvcr_hit_tokens_total") == 2 * PAGE
    assert _value(registry, "sglang:kvcr_loads_total") == 1
    assert _value(registry, "sglang:kvcr_lookups_total") == snap["lookups"] >= 1
    assert _value(registry, "sglang:kvcr_resident_keys") == 3
    assert _value(registry, "sglang:kvcr_dram_used_bytes") == 3 * PAGE_BYTES
    assert _value(registry, "sglang:kvcr_dram_bytes") == snap["dram_bytes"] > 0
    assert _value(registry, "sglang:kvcr_claims_held") == snap["claims_held"]
    assert _value(registry, "sglang:kvcr_restore_copy_seconds_count") == 1
    assert _value(registry, "sglang:kvcr_restore_copy_seconds_sum") > 0
    assert _value(registry, "sglang:kvcr_misses_total", cause="unclaimed") == 0
    # A second round moves the counters by its own amounts only.
    prepare(linker, "r2", hashes[2:])
    assert restore(linker, "r2", hashes[2:], [9])
    metrics.tick(2.0)
    metrics.tick(3.0, force=True)  # nothing new: nothing moves
    assert _value(registry, "sglang:kvcr_restored_bytes_total") == 3 * PAGE_BYTES
    assert _value(registry, "sglang:kvcr_hit_tokens_total") == 3 * PAGE
    assert _value(registry, "sglang:kvcr_restore_copy_seconds_count") == 2
    assert _value(registry, "sglang:kvcr_lookups_total") == float(
        linker.stats_snapshot()["lookups"]
    )
    linker.release_request("r")
    linker.release_request("r2")


def _snapshot(adapter: AdapterStats, hints: HintStats) -> dict:
    gauges = linker_stats.Gauges(
        linker_stats.DramGauges(),
        linker_stats.ResidencyGauges(),
        linker_stats.PreparationGauges(),
        inbound_refused=0,
    )
    return linker_stats.snapshot(
        linker_stats.LinkerStats(), gauges, adapter, hints.as_dict()
    )


def test_a_source_restarted_from_zero_counts_from_zero():
    registry = CollectorRegistry()
    samples = linker_stats.Samples()
    adapter, hints = AdapterStats(), HintStats()
    metrics = linker_metrics.LinkerMetrics(
        LABELS, PAGE, lambda: _snapshot(adapter, hints), samples, registry
    )
    assert samples.kept  # the exporter turned sample keeping on
    adapter.refused_offload, hints.accepted = 5, 4
    metrics.tick(0.0)
    adapter = AdapterStats(refused_offload=2)  # a flush started a new adapter
    metrics.tick(1.0)
    name = "sglang:kvcr_backpressure_refusals_total"
    assert _value(registry, name, cause="offload_budget") == 7
    assert _value(registry, name, cause="prepare_budget") == 0
    assert _value(registry, "sglang:kvcr_hints_accepted_total") == 4
    samples.add(linker_stats.Sample.ADMISSION_WAIT, 0.2)
    metrics.tick(2.0)
    assert _value(registry, "sglang:kvcr_admission_wait_seconds_count") == 1
    assert _value(registry, "sglang:kvcr_admission_wait_seconds_bucket", le="0.25") == 1
    assert _value(registry, "sglang:kvcr_admission_wait_seconds_bucket", le="0.1") == 0


def _registered(registry) -> dict[str, tuple[str, str]]:
    out = {}
    for family in registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        own = {k for s in family.samples for k in s.labels} - set(LABELS) - {"le"}
        out[name] = (family.type, "".join(sorted(own)))
    return out


def test_the_registry_holds_exactly_the_documented_families():
    registry = CollectorRegistry()
    linker_metrics.LinkerMetrics(
        LABELS, PAGE, lambda: {}, linker_stats.Samples(), registry
    )
    assert _registered(registry) == linker_metrics.exported_names()
    doc = (REPO / "docs" / "kvcr_direct_linker.md").read_text()
    section = doc.split("\n## Metrics reference\n", 1)[1].split("\n## ", 1)[0]
    rows, values = {}, {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 4 and cells[1].startswith("`sglang:kvcr_"):
            kind, name, label, meaning = cells
            name = name.strip("`")
            rows[name] = (kind, label.strip("`") if label != "-" else "")
            listed = meaning.split("Values: ", 1)[1] if "Values: " in meaning else ""
            values[name] = set(re.findall(r"`([a-z_]+)`", listed))
            assert len(meaning) > 20, name
    assert rows == linker_metrics.exported_names()
    for family in linker_metrics.FAMILIES:  # each label value is listed
        own = {s.value for s in family.series} if family.label else set()
        assert values[family.name] == own, family.name
    # A second linker of the process reuses the families (no duplicate error).
    linker_metrics.LinkerMetrics(
        LABELS, PAGE, lambda: {}, linker_stats.Samples(), registry
    )
    assert _registered(registry) == linker_metrics.exported_names()


def test_without_enable_metrics_nothing_is_imported_or_registered():
    script = textwrap.dedent(
        """
        import sys
        from cpu_harness.kvcr_pages import (
            fill_random, hashes_for, make_linker, make_pool, offload_and_commit,
        )
        pool = make_pool("cpu")
        lk = make_linker(pool)
        fill_random(pool, [1], seed=1)
        assert offload_and_commit(lk, hashes_for(1, "off"), [1], "cpu") is True
        lk.report.tick(force=True)
        lk.close()
        from sglang.srt.mem_cache.storage.kvcr.observability import linker_metrics
        print("METRICS", type(lk.report.metrics).__name__, lk.stats.samples.kept)
        print("IMPORTED", "prometheus_client" in sys.modules)
        import prometheus_client
        names = [m.name for m in prometheus_client.REGISTRY.collect()]
        print("KVCR", [n for n in names if n.startswith("sglang:kvcr_")])
        """
    )
    env = server_env()
    env["PYTHONPATH"] += f":{REPO / 'test'}"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=str(REPO),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "METRICS NoMetrics False" in out, out
    assert "IMPORTED False" in out, out
    assert "KVCR []" in out, out


def test_every_series_reads_a_snapshot_number():
    """Each family's series names a number the stats line prints."""
    snap = _snapshot(AdapterStats(), HintStats())
    for family in linker_metrics.FAMILIES:
        assert family.name.startswith("sglang:kvcr_")
        histogram = family.kind is linker_metrics.Kind.HISTOGRAM
        assert (family.sample is not None) == histogram == (not family.series)
        for series in family.series:
            value = snap
            for key in series.path:
                value = value[key]
            assert isinstance(value, int), (family.name, series.path)
