"""Writes the Grafana dashboard over the KVCR linker's ``sglang:kvcr_*`` families.

    python examples/monitoring/kvcr_dashboard.py           # rewrite the JSON
    python examples/monitoring/kvcr_dashboard.py --check   # exit 1 if it is stale

The panels are declared below (``PANELS``: title, unit, and one PromQL query per
line); ``dashboard()`` turns them into the JSON Grafana imports
(``grafana/dashboards/json/sglang-kvcr-dashboard.json``). It follows SGLang's own
dashboard (``examples/monitoring/grafana/dashboards/json/sglang-dashboard.json``
in the SGLang repository): a Prometheus data source, the ``model_name`` and
``instance`` template variables, queries filtered by them, ``$__rate_interval``
for rates. Every series the linker exports carries SGLang's scheduler labels
(``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``,
``dp_rank``) plus at most one own label (``cause``, ``reason``, ``op``).
Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "grafana" / "dashboards" / "json" / "sglang-kvcr-dashboard.json"
SEL = '{model_name=~"$model_name", instance=~"$instance"}'
RATE = "[$__rate_interval]"
QUANTILES = (("p50", "0.5"), ("p90", "0.9"), ("p99", "0.99"))


@dataclasses.dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclasses.dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    description: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"


def rate(family: str, by: str = "instance") -> str:
    return f"sum by ({by}) (rate({family}{SEL}{RATE}))"


def gauge(family: str, by: str = "instance") -> str:
    return f"sum by ({by}) ({family}{SEL})"


def quantiles(family: str) -> tuple[Query, ...]:
    bucket = f"{family}_bucket"
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by (le, instance) "
            f"(rate({bucket}{SEL}{RATE})))",
            f"{name} {{{{instance}}}}",
        )
        for name, q in QUANTILES
    )


PANELS: tuple[Panel, ...] = (
    Panel(
        "KVCR hit tokens/s",
        "short",
        "Prompt tokens the linker reported restorable from KVCR DRAM (local or "
        "fetched from a peer), per second.",
        (Query(rate("sglang:kvcr_hit_tokens_total"), "{{instance}}"),),
    ),
    Panel(
        "KVCR hit ratio (of prompt tokens)",
        "percentunit",
        "KVCR hit tokens over the prompt tokens SGLang processed, per worker.",
        (
            Query(
                f"{rate('sglang:kvcr_hit_tokens_total')} / "
                f"{rate('sglang:prompt_tokens_total')}",
                "{{instance}}",
            ),
        ),
    ),
    Panel(
        "Restored and offloaded bytes/s",
        "Bps",
        "Bytes restores copied from KVCR DRAM into the KV pool, and bytes "
        "write-through offloads stored in KVCR DRAM.",
        (
            Query(rate("sglang:kvcr_restored_bytes_total"), "restored {{instance}}"),
            Query(rate("sglang:kvcr_offloaded_bytes_total"), "offloaded {{instance}}"),
        ),
    ),
    Panel(
        "Restores and offloads/s",
        "short",
        "Restores queued and pages offloaded per second.",
        (
            Query(rate("sglang:kvcr_loads_total"), "restores {{instance}}"),
            Query(
                rate("sglang:kvcr_offloaded_pages_total"),
                "offloaded pages {{instance}}",
            ),
        ),
    ),
    Panel(
        "Prepare wait (p50, p90, p99)",
        "s",
        "From a preparation's start until its pages landed (or its deadline).",
        quantiles("sglang:kvcr_prepare_wait_seconds"),
    ),
    Panel(
        "Admission wait (p50, p90, p99)",
        "s",
        "How long the readiness gate held a request before admitting it.",
        quantiles("sglang:kvcr_admission_wait_seconds"),
    ),
    Panel(
        "Misses by cause",
        "short",
        "Lookups that found nothing restorable, per second, by cause.",
        (Query(rate("sglang:kvcr_misses_total", "cause"), "{{cause}}"),),
    ),
    Panel(
        "Backpressure and inbound refusals",
        "short",
        "Operations refused by a bound (by what was full), and control "
        "connections this worker refused, per second.",
        (
            Query(
                rate("sglang:kvcr_backpressure_refusals_total", "cause"), "{{cause}}"
            ),
            Query(
                rate("sglang:kvcr_inbound_refused_total"),
                "inbound refused {{instance}}",
            ),
        ),
    ),
    Panel(
        "KVCR DRAM used / configured",
        "bytes",
        "Bytes of the objects resident in KVCR DRAM, and the DRAM share "
        "configured, summed over a worker's ranks.",
        (
            Query(gauge("sglang:kvcr_dram_used_bytes"), "used {{instance}}"),
            Query(gauge("sglang:kvcr_dram_bytes"), "configured {{instance}}"),
        ),
    ),
    Panel(
        "KVCR DRAM used fraction",
        "percentunit",
        "Resident bytes over the configured share.",
        (
            Query(
                f"{gauge('sglang:kvcr_dram_used_bytes')} / "
                f"{gauge('sglang:kvcr_dram_bytes')}",
                "{{instance}}",
            ),
        ),
        kind="gauge",
    ),
    Panel(
        "Quarantined bytes and peer fetches off",
        "bytes",
        "KVCR DRAM held by instances quarantined after unclean flushes; "
        "peer fetches stop past max_quarantined_cores (1 = off).",
        (
            Query(gauge("sglang:kvcr_quarantined_bytes"), "quarantined {{instance}}"),
            Query(
                gauge("sglang:kvcr_peer_fetches_off"),
                "peer fetches off {{instance}}",
            ),
        ),
    ),
    Panel(
        "Hints accepted, rejected, ignored",
        "short",
        "kv.fetch hints per second: accepted, rejected by reason, ignored by reason.",
        (
            Query(rate("sglang:kvcr_hints_accepted_total"), "accepted {{instance}}"),
            Query(
                rate("sglang:kvcr_hints_rejected_total", "reason"),
                "rejected {{reason}}",
            ),
            Query(
                rate("sglang:kvcr_hints_ignored_total", "reason"),
                "ignored {{reason}}",
            ),
        ),
    ),
    Panel(
        "Failures and evictions",
        "short",
        "Restores that failed (request aborted), restore copies that raised, "
        "failed offloads, pages KVCR evicted for capacity, KVCR failures and "
        "restarts, per second; and how many of a worker's ranks have KVCR down "
        "(every request recomputed until a restart).",
        (
            Query(rate("sglang:kvcr_load_failures_total"), "load failures"),
            Query(rate("sglang:kvcr_restore_copy_failures_total"), "copy failures"),
            Query(rate("sglang:kvcr_offload_failures_total"), "offload failures"),
            Query(rate("sglang:kvcr_evicted_pages_total"), "evicted pages"),
            Query(rate("sglang:kvcr_failures_total"), "KVCR failures"),
            Query(rate("sglang:kvcr_restarts_total"), "KVCR restarts"),
            Query(gauge("sglang:kvcr_down"), "KVCR down {{instance}}"),
        ),
    ),
    Panel(
        "Restore copy time (p50, p90, p99)",
        "s",
        "Each restored request's copy time (its restore batch's copy).",
        quantiles("sglang:kvcr_restore_copy_seconds"),
    ),
)

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def panel_json(panel: Panel, index: int) -> dict:
    targets = [
        {
            "datasource": DATASOURCE,
            "editorMode": "code",
            "expr": q.expr,
            "legendFormat": q.legend,
            "range": True,
            "refId": chr(ord("A") + i),
        }
        for i, q in enumerate(panel.queries)
    ]
    body: dict = {
        "datasource": DATASOURCE,
        "description": panel.description,
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "id": index + 1,
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": targets,
        "title": panel.title,
        "type": panel.kind,
    }
    if panel.kind == "gauge":
        body["fieldConfig"]["defaults"].update({"min": 0, "max": 1})
        body["options"] = {"reduceOptions": {"calcs": ["lastNotNull"]}}
    return body


def variable(name: str, label: str, query: str) -> dict:
    return {
        "current": {},
        "datasource": DATASOURCE,
        "definition": query,
        "includeAll": True,
        "multi": True,
        "label": label,
        "name": name,
        "query": {"qryType": 1, "query": query, "refId": f"{name}-query"},
        "refresh": 1,
        "type": "query",
    }


def dashboard() -> dict:
    return {
        "annotations": {"list": []},
        "description": "KVCR direct linker for SGLang: hits, bytes moved, "
        "preparation and admission waits, misses, refusals, KVCR DRAM.",
        "editable": True,
        "panels": [panel_json(p, i) for i, p in enumerate(PANELS)],
        "refresh": "5s",
        "schemaVersion": 41,
        "tags": ["sglang", "kvcr"],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "data source",
                    "type": "datasource",
                    "query": "prometheus",
                },
                variable(
                    "model_name",
                    "model name",
                    "label_values(sglang:kvcr_dram_bytes, model_name)",
                ),
                variable(
                    "instance",
                    "instance",
                    "label_values(sglang:kvcr_dram_bytes, instance)",
                ),
            ]
        },
        "time": {"from": "now-30m", "to": "now"},
        "timezone": "browser",
        "title": "SGLang KVCR direct linker",
        "uid": "sglang-kvcr-dashboard",
        "version": 1,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if OUT is stale")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
