"""The microbench's replay and write-through metrics from samples and stats lines
(``kvcr_drivers.bench.serving_replay``), without a server.

Samples are shaped as ``serving.stream_ttft`` returns them; stats lines are the
linker's own ``stats_line`` format. A kvcr replay that did not come from KVCR, a
none replay that was not recomputed, or a hit that was not a device hit must fail
the replay metrics; refusals are every refusal counter's delta; the medians leave
the warm-up round out.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

from kvcr_drivers.bench import serving, serving_replay
from kvcr_drivers.bench.serving_replay import (
    check_round,
    fillers_for,
    replay_metrics,
    write_through_metrics,
)
from sglang.srt.mem_cache.storage.kvcr.observability.linker_stats import stats_line

NEED = 900


def sample(ms: float, device: int = 0, external: int = 0) -> dict[str, Any]:
    return {
        "ttft_ms": ms,
        "e2e_ms": ms + 1.0,
        "cached_tokens": device + external,
        "device_cached_tokens": device,
        "external_cached_tokens": external,
        "output_tokens": 1,
    }


def good_round(
    hit_ms: float, replay_ms: float, recompute_ms: float
) -> dict[str, dict[str, Any]]:
    return {
        "kvcr": {
            "cold": sample(150.0),
            "hit": sample(hit_ms, device=1008),
            "replay": sample(replay_ms, external=1008),
        },
        "none": {
            "cold": sample(150.0),
            "hit": sample(hit_ms, device=1008),
            "replay": sample(recompute_ms),
        },
    }


def rounds_of(*triples: tuple[float, float, float]) -> list[dict[str, Any]]:
    """Round 0 (a warm-up, far-off numbers) then one round per triple."""
    warm = {"warmup": True, "samples": good_round(500.0, 900.0, 100.0)}
    return [warm] + [{"warmup": False, "samples": good_round(*t)} for t in triples]


def by_name(metrics: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in metrics}


def line(**counters: int) -> str:
    """A KVCR_STATS line with the write-through counters (others as logged)."""
    values = {
        "lookups": 3,
        "offloads": 0,
        "offload_pages": 0,
        "offload_failures": 0,
        "staging_full": 0,
        "misses": {"prefix_moved": 0, "unclaimed": 2},
        "offloaded_bytes": 0,
        "prepare_wait_ms_avg": 1.25,
        "refused_offload": 0,
        "hints": {},
    }
    return stats_line({**values, **counters})


# ------------------------------------------------------------------ replay


def test_a_round_served_as_it_should_be_has_nothing_wrong():
    assert check_round(good_round(20.0, 21.0, 150.0), NEED) == []


def test_each_wrong_source_is_named():
    r = good_round(20.0, 21.0, 150.0)
    r["kvcr"]["replay"] = sample(21.0, device=1008)  # the device kept P
    r["none"]["replay"] = sample(30.0, device=1008)  # not evicted
    r["none"]["hit"] = sample(150.0)  # no hit at all
    wrong = check_round(r, NEED)
    assert len(wrong) == 3, wrong
    assert wrong[0].startswith("none: the second P was not a device hit"), wrong
    assert wrong[1].startswith("kvcr: the replay was not served from KVCR"), wrong
    assert wrong[2].startswith("none: the replay was not recomputed"), wrong
    short = good_round(20.0, 21.0, 150.0)
    short["kvcr"]["replay"] = sample(21.0, external=NEED - 16)
    assert check_round(short, NEED)[0].startswith("kvcr: the replay was not served")
    mixed = good_round(20.0, 21.0, 150.0)  # part of P still on the device
    mixed["kvcr"]["replay"] = sample(21.0, device=16, external=1008)
    assert check_round(mixed, NEED)[0].startswith("kvcr: the replay was not served")


def test_replay_ratios_are_medians_of_the_measured_rounds():
    rounds = rounds_of((20.0, 21.0, 150.0), (10.0, 30.0, 100.0), (40.0, 26.0, 200.0))
    m = by_name(replay_metrics(rounds, NEED))
    hit = m["replay_ttft_vs_device_hit"]
    assert (hit["value"], hit["baseline"]) == (26.0, 20.0)  # warm-up left out
    assert hit["ratio"] == 1.3 and hit["passed"] is False and "error" not in hit
    assert hit["target"] == "ratio <= 1.05" and hit["samples"] == 3
    recompute = m["replay_ttft_vs_recompute"]
    assert (recompute["value"], recompute["baseline"]) == (26.0, 150.0)
    assert recompute["target"] is None and recompute["passed"] is None
    fast = by_name(replay_metrics(rounds_of((20.0, 20.5, 150.0)), NEED))
    assert fast["replay_ttft_vs_device_hit"]["passed"] is True


def test_the_replay_ratio_carries_a_bootstrap_interval_of_the_measured_rounds():
    """The interval resamples the measured rounds only: rounds all at one ratio
    give that ratio at both ends (the warm-up, at 1.8, would widen it), and spread
    rounds give an interval around the point ratio."""
    same = rounds_of(*[(20.0, 22.0, 150.0)] * 3)
    ci = by_name(replay_metrics(same, NEED))["replay_ttft_vs_device_hit"]["ratio_ci90"]
    assert ci == [1.1, 1.1]
    spread = rounds_of(*[(20.0 + i, 22.0 + 3 * (i % 4), 150.0) for i in range(12)])
    hit = by_name(replay_metrics(spread, NEED))["replay_ttft_vs_device_hit"]
    lo, hi = hit["ratio_ci90"]
    assert lo < hit["ratio"] < hi


def test_a_replay_not_from_kvcr_fails_loudly_even_in_the_warm_up():
    rounds = rounds_of((20.0, 20.0, 150.0), (20.0, 20.0, 150.0))
    rounds[0]["samples"]["kvcr"]["replay"] = sample(900.0)  # recomputed
    m = by_name(replay_metrics(rounds, NEED))
    for name in serving_replay.REPLAY_METRICS:
        assert m[name]["passed"] is (False if m[name]["target"] else None), m
        assert m[name]["error"].startswith("round 0: kvcr: the replay was not"), m
    hit = m["replay_ttft_vs_device_hit"]
    assert hit["ratio"] == 1.0 and hit["passed"] is False  # within target, still


def test_no_measured_round_is_an_error_not_a_number():
    m = by_name(replay_metrics(rounds_of()[:1], NEED))
    assert m["replay_ttft_vs_device_hit"]["value"] is None
    assert "no measured round" in m["replay_ttft_vs_device_hit"]["error"]


def with_fillers(
    rounds: list[dict[str, Any]], kvcr: list[float], none: list[float]
) -> list[dict[str, Any]]:
    """``rounds`` with every server's fillers at these TTFTs (cold P: 150 ms)."""
    for r in rounds:
        r["samples"]["kvcr"]["fillers"] = [sample(ms) for ms in kvcr]
        r["samples"]["none"]["fillers"] = [sample(ms) for ms in none]
    return rounds


def test_back_to_back_slowdowns_are_kvcrs_over_nones_against_each_cold_p():
    """Each round's median filler, then the median over the measured rounds
    (neither a pooled median nor a mean), over the median cold P, per server."""
    rounds = with_fillers(
        rounds_of(*[(20.0, 21.0, 150.0)] * 3),
        kvcr=[160.0, 180.0, 900.0],  # a round's median: 180 (its mean: 413)
        none=[130.0, 140.0, 160.0],
    )
    rounds[2]["samples"]["kvcr"]["fillers"] = [sample(ms) for ms in (100.0, 160.0)]
    rounds[3]["samples"]["kvcr"]["fillers"] = [
        sample(ms) for ms in (250.0, 270.0, 280.0)
    ]
    # kvcr's round medians: 180, 130, 270 -> 180 (mean 193; all its fillers
    # pooled: 215); the warm-up's 1000, were it counted, would make it 225.
    rounds[0]["samples"]["kvcr"]["fillers"] = [sample(1000.0)] * 3
    rounds[1]["samples"]["none"]["cold"] = sample(100.0)  # none's cold: 150
    rounds[2]["samples"]["none"]["cold"] = sample(120.0)  # 100, 120, 150 -> 120
    m = serving_replay.back_to_back_metric(rounds)
    assert m["name"] == "write_through_back_to_back" and "error" not in m, m
    assert m["value"] == round(180.0 / 150.0, 4)  # kvcr's slowdown
    assert m["baseline"] == round(140.0 / 120.0, 4)  # none's
    assert m["ratio"] == round((180.0 / 150.0) / (140.0 / 120.0), 4)
    assert m["passed"] is None and m["samples"] == 3
    assert m["kvcr_over_none_back_to_back"] == round(180 / 140, 4)


def test_a_cached_or_missing_sample_makes_back_to_back_an_error():
    rounds = with_fillers(rounds_of((20.0, 21.0, 150.0)), [160.0], [150.0])
    rounds[1]["samples"]["kvcr"]["fillers"] = [sample(10.0, device=16)]
    rounds[0]["samples"]["none"]["fillers"] = []
    rounds[1]["samples"]["none"]["cold"] = sample(10.0, external=16)
    m = serving_replay.back_to_back_metric(rounds)
    assert m["value"] is None and m["ratio"] is None, m
    assert "round 0: none had no filler" in m["error"], m
    assert "round 1: kvcr served a filler from cache" in m["error"], m
    assert "round 1: none served its cold P from cache" in m["error"], m


def test_fillers_cycle_the_device_pool_twice():
    assert fillers_for(8192, 1024) == 18  # the microbench's pool of 8 prompts
    assert fillers_for(4096, 1024) == 10  # kvcr_bench's evict_replay default


# ----------------------------------------------------------- write-through


def test_write_through_counts_pages_per_running_second_and_every_refusal():
    before = line(offloads=10, offload_pages=600, offload_failures=1)
    after = line(
        offloads=60,
        offload_pages=3800,
        offload_failures=3,
        refused_offload=4,
        staging_full=5,
        offloaded_bytes=1 << 20,
    )
    m = by_name(write_through_metrics(before, after, 16.0, 50))
    rate = m["write_through_pages_per_s"]
    assert rate["value"] == 200.0 and rate["passed"] is None
    assert (rate["offload_pages"], rate["offloads"]) == (3200, 50)
    assert rate["pages_per_prefill"] == 64.0
    refused = m["write_through_refusals"]
    assert refused["value"] == 2 + 4 + 5 and refused["passed"] is False
    assert (refused["offload_failures"], refused["refused_offload"]) == (2, 4)
    assert refused["staging_full"] == 5 and refused["target"] == "value == 0"


def test_no_refusal_passes():
    before, after = line(offload_pages=64), line(offload_pages=128, offloads=1)
    m = by_name(write_through_metrics(before, after, 2.0, 1))
    assert m["write_through_refusals"]["value"] == 0
    assert m["write_through_refusals"]["passed"] is True
    assert m["write_through_pages_per_s"]["value"] == 32.0


def test_missing_lines_or_no_offload_are_errors():
    m = by_name(write_through_metrics(line(), None, 2.0, 1))
    assert "after the replay rounds" in m["write_through_refusals"]["error"]
    assert m["write_through_refusals"]["passed"] is False
    idle = by_name(write_through_metrics(line(), line(), 2.0, 1))
    assert idle["write_through_refusals"]["passed"] is False
    assert "offloaded no page" in idle["write_through_pages_per_s"]["error"]


def test_prefill_chunk_is_whole_pages_and_holds_a_prompt():
    """SGLang refuses a chunked-prefill size that is not a whole number of pages
    (the GPU bench's 3000-token prompts at page 64 failed every server start)."""
    cases = [(3000, 64, 3008), (1024, 64, 1024), (1024, 16, 1024), (100, 64, 512)]
    for tokens, page, want in cases:
        got = serving.prefill_chunk(tokens, page)
        assert got == want and got % page == 0 and got >= tokens, (tokens, page)


def test_the_hit_and_the_replay_each_start_after_a_pause(monkeypatch):
    """Each hit and replay sample starts ``serving.SETTLE_S`` after the request before
    it (the cold P, the last filler), whose write-through runs a few ms after its
    response, on both servers alike."""
    events: list[tuple[str, str]] = []
    fillers = fillers_for(128, 64)
    # Each server's round, run whole while it is resumed: two rounds each.
    kinds = iter((["cold", "hit"] + ["filler"] * fillers + ["replay"]) * 4)

    def stream_ttft(server, ids, n, timeout):
        kind = next(kinds)
        events.append((server.base_url, kind))
        if kind == "hit":
            return sample(10.0, device=NEED)
        if kind == "replay" and server.base_url == "kvcr":
            return sample(11.0, external=NEED)
        return sample(20.0)

    monkeypatch.setattr(serving, "stream_ttft", stream_ttft)
    monkeypatch.setattr(serving, "running", lambda s: contextlib.nullcontext(0.0))
    monkeypatch.setattr(
        serving_replay.time, "sleep", lambda s: events.append(("", f"sleep {s}"))
    )
    stats = line(offloads=1, offload_pages=2, offloaded_bytes=3)
    servers = {
        n: SimpleNamespace(base_url=n, log_text=lambda: "") for n in ("none", "kvcr")
    }
    args = SimpleNamespace(
        ttft_prompt_len=64,
        ttft_page_size=16,
        seed=0,
        replay_rounds=1,
        itl_stats_wait_s=0.0,
    )
    details = {"decode_itl": {"kvcr_stats_after": ("2000-01-01 00:00:00", stats)}}
    monkeypatch.setattr(
        "kvcr_drivers.bench.serving_micro.stats_after", lambda *a: ("x", stats)
    )
    metrics: list[dict[str, Any]] = []
    serving_replay.bench_replay(args, servers, 128, details, metrics)
    pause = ("", f"sleep {serving.SETTLE_S}")
    for name in ("none", "kvcr"):
        mine = [e for e in events if e[0] in (name, "")]
        for i, (_, kind) in enumerate(mine):
            if kind in ("hit", "replay"):
                assert mine[i - 1] == pause, (name, kind, mine[i - 1])
    assert serving.SETTLE_S > 0
    assert [k for _, k in events].count(pause[1]) == 2 * 2 * 2  # 2 rounds x 2 servers
    # Every round's fillers ran back to back (no pause between them), timed.
    for name in ("none", "kvcr"):
        mine = [k for n, k in events if n in (name, "")]
        starts = [i for i, k in enumerate(mine) if k == "hit"]
        assert len(starts) == 2, mine
        for at in starts:
            assert mine[at + 1 : at + 2 + fillers] == ["filler"] * fillers + [
                "sleep " + str(serving.SETTLE_S)
            ], mine
    b2b = by_name(metrics)["write_through_back_to_back"]
    assert "error" not in b2b and b2b["ratio"] == 1.0, b2b
    # UNITS (what a failed section reports in its place) is what it reports.
    assert {m["name"]: m["unit"] for m in metrics} == serving_replay.UNITS
    assert [m["name"] for m in metrics] == list(serving_replay.UNITS)
