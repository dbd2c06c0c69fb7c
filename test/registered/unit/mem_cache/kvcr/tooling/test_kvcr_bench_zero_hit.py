"""The zero-hit TTFT figure's uncertainty: ``metrics.ratio_ci`` (a paired bootstrap
interval of a ratio of medians) and the ``ratio_ci90`` that
``serving_micro.zero_hit_details`` puts on ``zero_hit_ttft_ratio``. The interval is
what tells a run that missed (or met) 1.02x by a hair from one that could not tell
the two apart on a noisy host."""

from __future__ import annotations

import argparse
import random
import statistics

import pytest

from kvcr_drivers.bench.metrics import bootstrap_ratios, ratio_ci
from kvcr_drivers.bench.serving_micro import zero_hit_details


def noisy(n: int, seed: int, scale: float = 1.0) -> list[float]:
    rng = random.Random(seed)
    return [scale * rng.uniform(40.0, 70.0) for _ in range(n)]


def test_identical_arms_give_a_point_interval_at_one():
    a = noisy(50, 1)
    assert ratio_ci(a, list(a)) == (1.0, 1.0)


def point(a: list[float], b: list[float]) -> float:
    return statistics.median(a) / statistics.median(b)


def test_a_clear_ten_percent_slowdown_is_bracketed_and_excludes_one():
    base = noisy(120, 2)
    rng = random.Random(3)
    slow = [x * 1.10 * rng.uniform(0.97, 1.03) for x in base]
    low, high = ratio_ci(slow, base)
    assert 1.0 < low <= point(slow, base) <= high < 1.2
    wide_low, wide_high = ratio_ci(slow, base, level=0.999)
    assert wide_low < 1.10 < wide_high


def test_unrelated_noise_gives_an_interval_wider_than_its_paired_twin():
    base = noisy(120, 4)
    paired = [x * 1.02 for x in base]
    unpaired = noisy(120, 5, scale=1.02)
    p_low, p_high = ratio_ci(paired, base)
    u_low, u_high = ratio_ci(unpaired, base)
    assert p_high - p_low < 0.001  # every resample keeps the 2% exactly
    assert u_high - u_low > 0.03  # independent rounds: the medians wander
    assert u_low <= point(unpaired, base) <= u_high


def test_the_interval_is_reproducible_and_ordered():
    a, b = noisy(80, 6), noisy(80, 7)
    assert ratio_ci(a, b) == ratio_ci(a, b)
    low, high = ratio_ci(a, b, level=0.5)
    wide_low, wide_high = ratio_ci(a, b, level=0.99)
    assert wide_low <= low <= high <= wide_high


def test_the_tails_left_out_are_even():
    """Each end is the resample with ``k`` others beyond it (ties allowed)."""
    a, b = noisy(40, 12), noisy(40, 13)
    reps = 1000
    ratios = bootstrap_ratios(a, b, reps, seed=1)
    for level in (0.5, 0.9, 0.95):
        low, high = ratio_ci(a, b, level=level, reps=reps, seed=1)
        k = round((1 - level) / 2 * reps)
        assert sum(r < low for r in ratios) <= k < sum(r <= low for r in ratios)
        assert sum(r > high for r in ratios) <= k < sum(r >= high for r in ratios)


@pytest.mark.parametrize("a,b", [([1.0, 2.0], [1.0]), ([1.0], [1.0])])
def test_unpaired_or_single_samples_are_refused(a, b):
    with pytest.raises(ValueError, match="paired"):
        ratio_ci(a, b)


@pytest.mark.parametrize("level,reps", [(0.0, 100), (1.0, 100), (1.5, 100), (0.9, 0)])
def test_a_level_outside_zero_one_or_no_resample_is_refused(level, reps):
    with pytest.raises(ValueError, match="level"):
        ratio_ci([1.0, 2.0], [1.0, 2.0], level=level, reps=reps)


def by_name(metrics: list[dict], name: str = "zero_hit_ttft_ratio") -> dict:
    (m,) = [m for m in metrics if m["name"] == name]
    return m


def round_of(ttft: dict[str, float], busy: float = 0.0) -> dict:
    return {
        "external_busy": busy,
        "samples": {n: {"ttft_ms": v, "cached_tokens": 0} for n, v in ttft.items()},
    }


def test_zero_hit_metric_carries_an_interval_around_its_ratio():
    none = noisy(60, 8)
    rng = random.Random(9)
    rounds = [
        round_of({"none": x, "kvcr": x * 1.05 * rng.uniform(0.9, 1.1)}) for x in none
    ]
    args = argparse.Namespace(quiet_round_busy=0.5, ttft_prompts=60)
    details: dict = {}
    metrics: list[dict] = []
    zero_hit_details(args, details, rounds, ["none", "kvcr"], metrics)
    m = by_name(metrics)
    low, high = m["ratio_ci90"]
    assert m["name"] == "zero_hit_ttft_ratio"
    assert low <= m["ratio"] <= high
    assert high - low < 0.2


def test_the_interval_leaves_out_the_busy_rounds_the_ratio_leaves_out():
    none = noisy(60, 10)
    quiet = [round_of({"none": x, "kvcr": x * 1.05}) for x in none]
    # Busy rounds where kvcr looked three times slower: not part of the figure.
    busy = [round_of({"none": x, "kvcr": 3 * x}, busy=0.9) for x in noisy(40, 11)]
    args = argparse.Namespace(quiet_round_busy=0.5, ttft_prompts=60)
    metrics: list[dict] = []
    zero_hit_details(args, {}, quiet + busy, ["none", "kvcr"], metrics)
    m = by_name(metrics)
    assert not m["noisy"] and m["samples"] == 60
    assert m["ratio_ci90"] == [1.05, 1.05]
    # Never quiet enough: every round counts, busy ones too, and it says so.
    args = argparse.Namespace(quiet_round_busy=0.5, ttft_prompts=90)
    metrics = []
    zero_hit_details(args, {}, quiet + busy, ["none", "kvcr"], metrics)
    m = by_name(metrics)
    assert m["noisy"] and m["samples"] == 100
    assert m["ratio_ci90"][1] > 1.1


def test_with_a_second_server_per_arm_the_ratio_uses_both_and_reports_their_spread():
    """One kvcr server slower by 10% than its twin (a server's layout, say):
    each round's arm is the mean of its two servers, the single-server ratio
    and each arm's spread are reported beside it."""
    none = noisy(60, 12)
    rounds = [
        round_of({"none": x, "none_twin": x, "kvcr": 1.1 * x, "kvcr_twin": 1.0 * x})
        for x in none
    ]
    args = argparse.Namespace(quiet_round_busy=0.5, ttft_prompts=60)
    details: dict = {}
    metrics: list[dict] = []
    names = ["none", "kvcr", "none_twin", "kvcr_twin"]
    zero_hit_details(args, details, rounds, names, metrics)
    m = by_name(metrics)
    assert m["servers_per_arm"] == 2
    assert m["ratio"] == pytest.approx(1.05, abs=1e-3)
    assert m["single_server_ratio"] == pytest.approx(1.1, abs=1e-3)
    assert m["instance_spread"] == {
        "kvcr": pytest.approx(1 / 1.1, abs=1e-3),
        "none": 1.0,
    }
    assert details["instance_spread"] == m["instance_spread"]
    # Without the twins (--quick): one server each, as before.
    metrics = []
    zero_hit_details(args, {}, rounds, ["none", "kvcr"], metrics)
    m = by_name(metrics)
    assert m["servers_per_arm"] == 1 and m["ratio"] == pytest.approx(1.1, abs=1e-3)
    assert m["instance_spread"] is None
