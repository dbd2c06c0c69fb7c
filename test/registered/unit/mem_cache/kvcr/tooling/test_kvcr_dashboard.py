"""The Grafana dashboard in examples/monitoring/ reads only what the linker exports.

Every panel query names an exported ``sglang:kvcr_*`` family (a histogram through
its ``_bucket``/``_sum``/``_count`` series, a counter only through ``rate``, a
gauge never through it) or an SGLang family the installed sglang defines; every
label it filters or groups by is one the series carries (SGLang's scheduler
labels, Prometheus's ``instance``/``job``, the family's own label, ``le`` for a
quantile) and every own-label value it names is one the family exports. Every
query is filtered by the ``model_name`` and ``instance`` variables, as SGLang's
own dashboard is. The topics the issue asked for each have a panel, and the
committed JSON is what ``kvcr_dashboard.py`` writes.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import sglang.srt.observability.metrics_collector as sglang_metrics

from sglang.srt.mem_cache.storage.kvcr.observability import linker_metrics

REPO = Path(__file__).resolve().parents[6]
MONITORING = REPO / "examples" / "monitoring"
JSON_PATH = (
    MONITORING / "grafana" / "dashboards" / "json" / "sglang-kvcr-dashboard.json"
)

# Labels SGLang's scheduler metrics carry (metric_labels); the kvcr families carry
# them too. dp_rank only with DP, but a query may group by it.
SCHEDULER_LABELS = (
    "model_name",
    "engine_type",
    "tp_rank",
    "pp_rank",
    "moe_ep_rank",
    "dp_rank",
)
PROMETHEUS_LABELS = ("instance", "job")
# SGLang families a panel may divide by, and the labels they carry.
SGLANG_FAMILIES = {
    "sglang:prompt_tokens_total": ("model_name", "engine_type", "is_streaming")
}
# What the issue asked the dashboard to show: family -> how it must be read.
REQUIRED = {
    "sglang:kvcr_hit_tokens_total": "rate",
    "sglang:kvcr_restored_bytes_total": "rate",
    "sglang:kvcr_offloaded_bytes_total": "rate",
    "sglang:kvcr_prepare_wait_seconds_bucket": "quantile",
    "sglang:kvcr_admission_wait_seconds_bucket": "quantile",
    "sglang:kvcr_misses_total": "by cause",
    "sglang:kvcr_backpressure_refusals_total": "by cause",
    "sglang:kvcr_inbound_refused_total": "rate",
    "sglang:kvcr_dram_used_bytes": "gauge",
    "sglang:kvcr_dram_bytes": "gauge",
    "sglang:kvcr_quarantined_bytes": "gauge",
}

NAME_RE = re.compile(r"(sglang:[A-Za-z0-9_:]+)(\{[^}]*\})?")
MATCHER_RE = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
GROUP_RE = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def exported() -> dict[str, tuple[str, str, frozenset[str]]]:
    """Every exported sample name -> (family kind, own label, own label values)."""
    names = {}
    for f in linker_metrics.FAMILIES:
        values = frozenset(s.value for s in f.series if s.value)
        if f.kind is linker_metrics.Kind.HISTOGRAM:
            for suffix in ("_bucket", "_sum", "_count"):
                names[f.name + suffix] = ("histogram", f.label, values)
        else:
            names[f.name] = (f.kind.value, f.label, values)
    return names


def load_generator():
    spec = importlib.util.spec_from_file_location(
        "kvcr_dashboard", MONITORING / "kvcr_dashboard.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def queries(board: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"]]


def problems(board: dict) -> list[str]:
    """What in ``board`` does not match what is exported (empty when all does)."""
    known = exported()
    found: list[str] = []
    for title, expr in queries(board):
        own_labels: set[str] = set()
        for m in NAME_RE.finditer(expr):
            name, selector = m.group(1), m.group(2) or ""
            matchers = MATCHER_RE.findall(selector)
            if name in SGLANG_FAMILIES:
                allowed = {*SGLANG_FAMILIES[name], *PROMETHEUS_LABELS}
                for label, _, _ in matchers:
                    if label not in allowed:
                        found.append(f"{title}: {name} has no label {label!r}")
                continue
            if name not in known:
                found.append(f"{title}: {name} is not exported")
                continue
            kind, own, values = known[name]
            before = expr[: m.start()].rstrip()
            in_rate = before.endswith(("rate(", "increase("))
            if kind == "counter" and not in_rate:
                found.append(f"{title}: counter {name} read without rate()")
            if kind == "gauge" and in_rate:
                found.append(f"{title}: gauge {name} read through rate()")
            if name.endswith("_bucket") and "histogram_quantile" not in expr:
                found.append(f"{title}: {name} outside histogram_quantile")
            if own:
                own_labels.add(own)
            if name.endswith("_bucket"):
                own_labels.add("le")
            for label, _, value in matchers:
                if label == own:
                    if value not in values and not value.startswith("$"):
                        found.append(f"{title}: {name} has no {label}={value!r}")
                elif label not in (*SCHEDULER_LABELS, *PROMETHEUS_LABELS):
                    found.append(f"{title}: {name} has no label {label!r}")
            found.extend(
                f"{title}: {name} not filtered by ${variable}"
                for variable in ("model_name", "instance")
                if (variable, "=~", f"${variable}") not in matchers
            )
        allowed = {*SCHEDULER_LABELS, *PROMETHEUS_LABELS, *own_labels}
        found.extend(
            f"{title}: groups by {label!r}, which it lacks"
            for group in GROUP_RE.findall(expr)
            for label in (g.strip() for g in group.split(","))
            if label and label not in allowed
        )
    return found


@pytest.fixture(scope="module")
def board() -> dict:
    return json.loads(JSON_PATH.read_text())


def test_committed_json_is_what_the_generator_writes():
    assert JSON_PATH.read_text() == load_generator().render()


def test_every_query_names_exported_families_and_labels(board):
    assert queries(board), "the dashboard has no queries"
    assert problems(board) == []


def test_the_check_catches_a_wrong_family_label_or_reading():
    """The check itself fails on each kind of mistake."""
    broken = {
        "sglang:kvcr_hit_tokens_total{": "sglang:kvcr_hit_token_total{",
        "sum by (cause) (rate(sglang:kvcr_misses_total": "sum by (reason) (rate(sglang:kvcr_misses_total",
        "rate(sglang:kvcr_inbound_refused_total": "(sglang:kvcr_inbound_refused_total",
        "sum by (instance) (sglang:kvcr_dram_bytes": "sum by (instance) (rate(sglang:kvcr_dram_bytes",
        'sglang:kvcr_quarantined_bytes{model_name=~"$model_name", ': "sglang:kvcr_quarantined_bytes{",
    }
    text = JSON_PATH.read_text()
    for old, new in broken.items():
        needle = json.dumps(old)[1:-1]
        assert needle in text, old
        board = json.loads(text.replace(needle, json.dumps(new)[1:-1], 1))
        assert problems(board), f"not caught: {old!r} -> {new!r}"


def test_sglang_labels_and_families_are_the_installed_ones():
    source = Path(sglang_metrics.__file__).read_text()
    for label in SCHEDULER_LABELS:
        assert f'"{label}":' in source, label
    for name in SGLANG_FAMILIES:
        assert f'name="{name}"' in source, name


def test_each_asked_topic_has_a_panel(board):
    exprs = [expr for _, expr in queries(board)]
    for name, how in REQUIRED.items():
        uses = [e for e in exprs if re.search(re.escape(name) + r"\{", e)]
        assert uses, f"no panel reads {name}"
        if how == "rate":
            assert any(f"rate({name}" in e for e in uses), name
        elif how == "quantile":
            assert {
                q for e in uses for q in re.findall(r"histogram_quantile\(([\d.]+)", e)
            } >= {
                "0.5",
                "0.9",
                "0.99",
            }, name
        elif how == "by cause":
            assert any(f"sum by (cause) (rate({name}" in e for e in uses), name
    ratio = [e for e in exprs if "sglang:kvcr_hit_tokens_total" in e and " / " in e]
    assert ratio, "no hit-ratio panel"
    dram = [e for e in exprs if "sglang:kvcr_dram_used_bytes" in e and " / " in e]
    assert any("sglang:kvcr_dram_bytes" in e.split(" / ")[1] for e in dram)


def test_variables_and_layout_follow_sglang_dashboards(board):
    names = {v["name"] for v in board["templating"]["list"]}
    assert {"model_name", "instance"} <= names
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert {p["datasource"]["type"] for p in board["panels"]} == {"prometheus"}
    for p in board["panels"]:
        assert p["description"] and p["fieldConfig"]["defaults"]["unit"], p["title"]
