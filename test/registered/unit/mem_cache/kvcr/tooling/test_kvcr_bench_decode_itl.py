"""The microbench's decode-ITL section (``serving_micro.bench_decode_itl``) with
its rounds stubbed, without a server.

Each arm's rounds are canned ``decode_itl.itl_round`` results with per-arm token
gaps, so the pooled summaries and the metrics can be checked exactly: the
metrics compare kvcr with no linker; SGLang's linker mode (the null linker),
when that control server runs, decodes the same rounds and is summarized beside
them, never taken as the metrics' baseline.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest

from kvcr_drivers.bench import decode_itl, serving, serving_micro

# Token gaps (ms) per arm: distinct, so a summary can only come from its arm.
GAPS = {"none": [4.0, 4.0, 5.0], "kvcr": [6.0, 6.0, 7.0], "null_linker": [9.0] * 3}


def args() -> SimpleNamespace:
    return SimpleNamespace(
        ttft_page_size=16,
        seed=0,
        ttft_prompt_len=64,
        itl_every_tokens=16,
        itl_output_len=32,
        itl_concurrency=2,
        itl_rounds=3,
        itl_stats_wait_s=0.05,
    )


@pytest.fixture
def stubbed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Stubbed rounds; what each round ran on, in order."""
    ran: list[str] = []

    def itl_round(base_url: str, *a: Any, **k: Any) -> dict[str, Any]:
        ran.append(base_url)
        return {
            "itl_ms": list(GAPS[base_url]),
            "background_done_in_window": 1,
            "background_failed": 0,
        }

    monkeypatch.setattr(decode_itl, "itl_round", itl_round)
    monkeypatch.setattr(serving, "running", lambda s: contextlib.nullcontext(0.0))
    return ran


# The kvcr server's KVCR_STATS lines: one before the rounds, one after them.
LOG = (
    "[2000-01-01 00:00:00] KVCR_STATS offloads=1 offload_pages=2 "
    "offloaded_bytes=100 offload_failures=0\n"
    "[2099-01-01 00:00:00] KVCR_STATS offloads=5 offload_pages=10 "
    "offloaded_bytes=900 offload_failures=0\n"
)


def servers(*names: str) -> dict[str, Any]:
    return {
        n: SimpleNamespace(base_url=n, log_text=lambda: LOG, generate=None)
        for n in names
    }


def test_the_null_linker_decodes_the_same_rounds_and_is_not_the_baseline(stubbed):
    details: dict[str, Any] = {}
    metrics: list[dict[str, Any]] = []
    serving_micro.bench_decode_itl(
        args(), servers("none", "kvcr", "null_linker"), details, metrics
    )
    summary = details["decode_itl"]["summary"]
    assert set(summary) == {"none", "kvcr", "null_linker"}
    assert {name: summary[name]["p50"] for name in summary} == {
        "none": 4.0,
        "kvcr": 6.0,
        "null_linker": 9.0,
    }
    # Round 0 warms every arm up; then 3 rounds each, every arm in every round.
    assert len(stubbed) == 3 * 4
    assert all(summary[name]["rounds"] == 3 for name in summary)
    by_name = {m["name"]: m for m in metrics}
    p50 = by_name["decode_itl_p50_ratio"]
    assert (p50["value"], p50["baseline"]) == (6.0, 4.0)
    assert by_name["decode_itl_p99_ratio"]["baseline"] == summary["none"]["p99"]
    assert all(m.get("error") is None for m in metrics)
    assert details["decode_itl"]["kvcr_offloaded_during_phase"] == {
        "offloads": 4,
        "offload_pages": 8,
        "offloaded_bytes": 800,
        "offload_failures": 0,
    }


def test_without_the_control_server_only_kvcr_and_none_run(stubbed):
    details: dict[str, Any] = {}
    metrics: list[dict[str, Any]] = []
    serving_micro.bench_decode_itl(args(), servers("none", "kvcr"), details, metrics)
    assert set(details["decode_itl"]["summary"]) == {"none", "kvcr"}
    assert sorted(set(stubbed)) == ["kvcr", "none"]
    assert {m["name"] for m in metrics} == {
        "decode_itl_p50_ratio",
        "decode_itl_p99_ratio",
    }
