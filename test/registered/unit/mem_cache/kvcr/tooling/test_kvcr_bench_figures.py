"""The one table of benchmark figures (docs/kvcr_direct_linker.md) against the bench.

The table is generated from a ``make bench`` report (``kvcr_drivers.bench.figures``).
Here it must be well formed, name exactly the metrics a default CPU run reports, in
report order, with the bench's own units and targets, and show a result that its
own numbers and those targets give; its source line must name the pinned kvcr and
nixl. A renamed metric, a changed target or a re-pinned dependency fails this until
the table is regenerated. The serving section's metrics are named here as well
(issue 23's whole path: decode ITL, the replay from KVCR against a device hit and
against recompute, the write-through rate and refusals, zero-hit TTFT), so the
table cannot lose one by being regenerated from a bench that dropped it.
"""

from __future__ import annotations

import re

from cpu_harness.server import REPO
from kvcr_drivers.bench import figures, micro
from kvcr_drivers.bench.metrics import target_of

DOCS = REPO / "docs" / "kvcr_direct_linker.md"
PINS = REPO / "requirements" / "cpu.txt"


def number(text: str) -> float | None:
    return None if text == "-" else float(text)


def table() -> tuple[str, list[dict[str, str]]]:
    return figures.parse(DOCS.read_text())


def test_the_table_names_every_metric_the_bench_reports_in_order():
    _, rows = table()
    assert [r["metric"] for r in rows] == micro.metric_names("cpu")


SERVING = {  # name: (unit, target on cpu)
    "decode_itl_p50_ratio": ("ms", None),
    "decode_itl_p99_ratio": ("ms", "ratio <= 1.1"),
    "replay_ttft_vs_device_hit": ("ms", "ratio <= 1.05"),
    "replay_ttft_vs_recompute": ("ms", None),
    "write_through_pages_per_s": ("pages/s", None),
    "write_through_refusals": ("count", "value == 0"),
    "write_through_back_to_back": ("x", None),
    "zero_hit_ttft_ratio": ("ms", "ratio <= 1.02"),
}


def test_the_serving_section_reports_issue_23s_whole_path():
    names = micro.metric_names("cpu")
    assert names[: len(SERVING)] == list(SERVING)
    for name, (unit, target) in SERVING.items():
        assert micro.metric_unit(name) == unit, name
        got = target_of(name, "cpu")
        assert (got.text() if got else None) == target, name


def test_units_and_targets_are_the_benchs_own():
    _, rows = table()
    for r in rows:
        name = r["metric"]
        assert r["unit"] == micro.metric_unit(name), r
        target = target_of(name, "cpu")
        assert r["target"] == (target.text() if target else "-"), r


def test_each_result_follows_from_the_rows_numbers():
    _, rows = table()
    for r in rows:
        values = {k: number(r[k]) for k in ("value", "baseline", "ratio")}
        target = target_of(r["metric"], "cpu")
        if target is None:
            assert r["result"] == "info", r
            continue
        if values["baseline"] is not None and values["value"] is not None:
            # The report rounds value, baseline and ratio to 4 decimals each.
            ratio = values["value"] / values["baseline"]
            assert abs(ratio - values["ratio"]) <= 1e-3 * max(1.0, ratio), r
        assert r["result"] == figures.RESULT[target.check(values)], r


def test_an_interval_is_two_ordered_numbers_around_nothing_else():
    """Where a row has a bootstrap interval it reads ``[low; high]``, low <= high;
    the zero-hit ratio always has one (its rounds are paired by prompt)."""
    _, rows = table()
    seen = {}
    for r in rows:
        if r["ci90"] == "-":
            continue
        low, high = (float(x) for x in r["ci90"].strip("[]").split(";"))
        assert low <= high, r
        seen[r["metric"]] = (low, high)
    assert "zero_hit_ttft_ratio" in seen


def test_the_source_line_names_the_pinned_versions():
    source, _ = table()
    pins = dict(re.findall(r"^([a-z0-9_-]+)==(\S+)", PINS.read_text(), re.MULTILINE))
    assert source.startswith("`make bench` on "), source
    for name in ("kvcr", "nixl"):
        assert f"{name} {pins[name]}" in source, (name, pins.get(name), source)


def test_a_report_with_other_metrics_is_refused():
    """The generator refuses a report that is not a default CPU run's."""
    metrics = [{"name": n} for n in micro.metric_names("cpu")[:-1]]
    try:
        figures.table({"metrics": metrics, "config": {"device": "cpu"}}, "today")
    except ValueError as exc:
        assert "not a default cpu run" in str(exc)
    else:
        raise AssertionError("a report missing a metric made a table")
